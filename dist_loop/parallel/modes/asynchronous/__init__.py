"""Asynchronous data parallelism in one process (`--mode=async`)."""

from dist_loop.parallel.modes.asynchronous.threads import WorkerFailed
from dist_loop.parallel.modes.asynchronous.trainer import AsyncTrainer  # Registers it.

__all__ = ["AsyncTrainer", "WorkerFailed"]
