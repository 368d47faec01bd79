"""Synchronous data parallelism (`--mode=sync`)."""

from dist_loop.modes.sync.trainer import SyncTrainer  # Registers the mode.
from dist_loop.modes.sync.trainer import make_strategy

__all__ = ["SyncTrainer", "make_strategy"]
