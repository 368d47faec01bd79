"""Parameter-server training (--mode=ps): the chief's trainer, the servers."""
from dist_loop.parallel.modes.ps.trainer import PSTrainer  # Registers the mode.

__all__ = ["PSTrainer"]
