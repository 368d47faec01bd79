"""Asynchronous data parallelism in one process (`--mode=async`)."""

from dist_loop.modes.asynchronous.trainer import AsyncTrainer  # Registers it.
from dist_loop.modes.asynchronous.threads import WorkerFailed

__all__ = ["AsyncTrainer", "WorkerFailed"]
