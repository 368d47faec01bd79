"""Parallel modes. This is the one place where a mode is chosen."""

from dist_loop.parallel.modes import asynchronous  # pylint: disable=unused-import
from dist_loop.parallel.modes import local_sgd  # pylint: disable=unused-import
from dist_loop.parallel.modes import pipeline  # pylint: disable=unused-import
from dist_loop.parallel.modes import ps  # pylint: disable=unused-import
from dist_loop.parallel.modes import sync  # Registers the modes.
from dist_loop.parallel.modes import xla
from dist_loop.parallel.modes.base import MODES, Report, Reporting, Trainer
from dist_loop.parallel.modes.loop import LoopEnd, LoopTrainer, StepResult
from dist_loop.runtime import strategy as strategy_lib


def build_trainer(config, devices, dataset, cluster) -> Trainer:
  """The registered `Trainer` of `config.mode`, built with
  `--jit_compile=auto` decided (`xla.resolve`: its `config` says True or
  False, its `xla_choice` why); on several workers of a
  MultiWorkerMirroredStrategy its variables take the chief's initial values
  in one collective (`strategy.initial_values_from_chief`)."""
  config, why = xla.resolve(config, devices, dataset, cluster)
  with strategy_lib.initial_values_from_chief():
    trainer = MODES.get(config.mode)(config, devices, dataset, cluster)
  trainer.xla_choice = why
  return trainer


__all__ = ["MODES", "LoopEnd", "LoopTrainer", "Report", "Reporting", "StepResult",
           "Trainer", "build_trainer"]
