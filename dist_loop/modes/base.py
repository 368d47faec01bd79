"""The one interface every parallel mode implements, and the mode registry.

A mode owns how a step is computed across devices: its strategy or threads,
the model's master variables, the optimizer and the inner loop. The
controller owns everything around it (schedule, evaluation, checkpoints,
summaries) and never looks inside. To add a mode, subclass `Trainer` in one
file and register it: `@MODES.register("name")`.
"""

import abc
from typing import Dict, List

import keras
import numpy as np
import tensorflow as tf

from dist_loop.config import Config, check_divisible
from dist_loop.data import Dataset
from dist_loop.errors import UserError
from dist_loop.registry import Registry

MODES: Registry = Registry("mode", "mode")


class Trainer(abc.ABC):
  """The inner loop of one parallel mode.

  Attributes:
    model: the `keras.Sequential` holding the master variables; evaluation
      and checkpoints read it.
    optimizer: the optimizer whose slots are checkpointed.
    step: int64 `tf.Variable`, the number of steps applied so far.
    is_chief: whether this process writes summaries, `summary.json`,
      flags.txt and the kept checkpoints.
    examples_per_step: examples consumed by one step, for throughput.
  """

  model: keras.Sequential
  optimizer: keras.optimizers.Optimizer
  step: tf.Variable
  is_chief: bool = True
  # The float16 DynamicLossScale (precision.py) of a mode that scales, else
  # None; checkpointed under one name in every mode.
  loss_scale = None
  # Whether the mode runs across the tasks of a TF_CONFIG cluster; the others
  # refuse a TF_CONFIG with several tasks (they would race on the workdir).
  multi_process: bool = False

  @classmethod
  def num_replicas(cls, config: Config) -> int:
    """Data-parallel replicas the global batch is split over."""
    return config.num_devices

  # Capabilities a mode opts into; validate_config refuses the rest.
  precisions = ("float32",)
  grad_accumulation = False
  skips_nonfinite = False  # Can drop a non-finite step (--nonfinite=skip).

  @classmethod
  def validate_config(cls, config: Config) -> None:
    """Mode-specific rules, checked before any work. Raises UserError."""
    check_divisible(config.global_batch_size, cls.num_replicas(config))

  @classmethod
  def check_capabilities(cls, config: Config) -> None:
    """Refuses features this mode did not opt into, before its own rules."""
    if config.precision not in cls.precisions:
      raise UserError(f"--precision={config.precision} is not supported in "
                      f"--mode={config.mode}; use one of "
                      f"{', '.join(cls.precisions)}")
    if config.nonfinite == "skip" and not cls.skips_nonfinite:
      raise UserError(f"--nonfinite=skip is not supported in --mode="
                      f"{config.mode}; use --nonfinite=rollback or raise")
    if config.grad_accum_steps > 1 and not cls.grad_accumulation:
      raise UserError(f"--grad_accum_steps is not supported in "
                      f"--mode={config.mode}; use --grad_accum_steps=1, or a "
                      "larger --global_batch_size")

  @classmethod
  def join_cluster(cls, config: Config) -> None:
    """Runs first in a process, before TensorFlow starts its runtime.

    A mode that spans processes joins its cluster here (a
    MultiWorkerMirroredStrategy must be built before any op runs); a process
    that only serves (a parameter server) serves here and never returns.
    The default, for single-process modes, does nothing.
    """

  def __init__(self, config: Config, devices: List[str], split: Dataset):
    self.config = config
    self.devices = devices
    self.split = split
    self.examples_per_step = config.global_batch_size * config.grad_accum_steps

  @abc.abstractmethod
  def train(self, num_steps: int) -> Dict[str, float]:
    """Runs `num_steps` steps; returns their mean metrics (`train/...`).

    Raises:
      NonFiniteError: a step produced NaN/Inf; that step was not applied.
    """

  def checkpoint_items(self) -> Dict[str, object]:
    """What the checkpoint holds. The same names in every mode, so a
    checkpoint written by one mode restores in another."""
    items = {"step": self.step, "model": self.model,
             "optimizer": self.optimizer}
    if self.loss_scale is not None:
      items["loss_scale"] = self.loss_scale
    return items

  def scope(self):
    """The scope under which eval and restore see the master variables."""
    return tf.distribute.get_strategy().scope()

  @classmethod
  def cluster_error(cls, config: Config, error: tf.errors.OpError):
    """The `UserError` (one line, naming the fix) that a TensorFlow runtime
    error raised anywhere in the run means in this mode, or None if it is
    not a lost peer. `train.run` asks once, for the whole run (a class
    method, so building the trainer is covered too): a peer can be lost
    while the variables are made, in a step, a checkpoint, an evaluation
    or a read of the step."""
    del config, error
    return None

  def on_restore(self) -> None:
    """Called after a checkpoint was restored mid-run (a rollback): the
    input must restart from the restored step."""

  def on_master(self, fn, *args):
    """Runs `fn(*args)` where the master variables can be differentiated.

    Mirrored variables only give gradients in replica context, so modes with
    a strategy run `fn` there and return the first replica's result.
    """
    return fn(*args)

  def images(self) -> Dict[str, np.ndarray]:
    """Images to log at log time, name -> HWC uint8 (e.g. a timeline)."""
    return {}

  def log_scalars(self) -> Dict[str, float]:
    """Scalars to log as they are at log time (running totals), not averaged
    over the window like `train`'s metrics."""
    return {}

  def histograms(self) -> Dict[str, np.ndarray]:
    """Values collected since the last log, written as histograms then."""
    return {}

  def extra_summary(self) -> Dict[str, object]:
    """Mode-specific entries merged into summary.json."""
    return {}

  def close(self) -> None:
    """Stops threads and frees devices. Safe to call twice."""
