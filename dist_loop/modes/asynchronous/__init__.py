"""Asynchronous data parallelism in one process."""
from dist_loop.modes.asynchronous.trainer import *  # noqa: F401,F403
from dist_loop.modes.asynchronous.trainer import AsyncTrainer  # noqa: F401
