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
import tensorflow as tf

from dist_loop.config import Config, check_divisible
from dist_loop.data import Split
from dist_loop.registry import Registry

MODES: Registry = Registry("mode", "mode")


class Trainer(abc.ABC):
  """The inner loop of one parallel mode.

  Attributes:
    model: the `keras.Sequential` holding the master variables; evaluation
      and checkpoints read it.
    optimizer: the optimizer whose slots are checkpointed.
    step: int64 `tf.Variable`, the number of steps applied so far.
    is_chief: whether this process writes summaries and `summary.json`.
    examples_per_step: examples consumed by one step, for throughput.
  """

  model: keras.Sequential
  optimizer: keras.optimizers.Optimizer
  step: tf.Variable
  is_chief: bool = True

  @classmethod
  def num_replicas(cls, config: Config) -> int:
    """Data-parallel replicas the global batch is split over."""
    return config.num_devices

  @classmethod
  def validate_config(cls, config: Config) -> None:
    """Mode-specific rules, checked before any work. Raises UserError."""
    check_divisible(config.global_batch_size, cls.num_replicas(config))

  def __init__(self, config: Config, devices: List[str], split: Split):
    self.config = config
    self.devices = devices
    self.split = split
    self.examples_per_step = config.global_batch_size

  @abc.abstractmethod
  def train(self, num_steps: int) -> Dict[str, float]:
    """Runs `num_steps` steps; returns their mean metrics (`train/...`).

    Raises:
      NonFiniteError: a step produced NaN/Inf; that step was not applied.
    """

  def checkpoint_items(self) -> Dict[str, object]:
    """What the checkpoint holds. The same names in every mode, so a
    checkpoint written by one mode restores in another."""
    return {"step": self.step, "model": self.model,
            "optimizer": self.optimizer}

  def scope(self):
    """The scope under which eval and restore see the master variables."""
    return tf.distribute.get_strategy().scope()

  def on_master(self, fn, *args):
    """Runs `fn(*args)` where the master variables can be differentiated.

    Mirrored variables only give gradients in replica context, so modes with
    a strategy run `fn` there and return the first replica's result.
    """
    return fn(*args)

  def close(self) -> None:
    """Stops threads and frees devices. Safe to call twice."""
