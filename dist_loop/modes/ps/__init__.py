"""Parameter-server training."""
from dist_loop.modes.ps.trainer import *  # noqa: F401,F403
from dist_loop.modes.ps.trainer import PSTrainer  # noqa: F401
