"""Synchronous data parallelism (`--mode=sync`)."""

from dist_loop.parallel.modes.sync.trainer import SyncTrainer  # Registers the mode.

__all__ = ["SyncTrainer"]
