"""Parallel modes. This is the one place where a mode is chosen."""

from dist_loop.modes import sync  # Registers the modes.
from dist_loop.modes import pipeline  # pylint: disable=unused-import
from dist_loop.modes import asynchronous  # pylint: disable=unused-import
from dist_loop.modes import ps  # pylint: disable=unused-import
from dist_loop.modes.base import MODES, Trainer


def build_trainer(config, devices, split) -> Trainer:
  """The registered `Trainer` of `config.mode`."""
  return MODES.get(config.mode)(config, devices, split)


__all__ = ["MODES", "Trainer", "build_trainer"]
