"""Synchronous data parallelism."""
from dist_loop.modes.sync.trainer import *  # noqa: F401,F403
from dist_loop.modes.sync.trainer import SyncTrainer, make_strategy  # noqa: F401
