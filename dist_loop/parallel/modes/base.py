"""The one interface every parallel mode implements, and the mode registry.

A mode owns how a step is computed across devices: its strategy or threads,
the master variables, the optimizer and the inner loop. It computes losses
and metrics only through the step core (`dist_loop/training/step.py`). The
controller owns everything around it (schedule, evaluation, checkpoints,
summaries) and never looks inside.

To add a mode: a package under `dist_loop/parallel/modes/` (or an extension
module) with a `Trainer` subclass, its `Options` dataclass of flags
(`dist_loop/core/options.py`), and `@MODES.register("name")`.
"""

import abc
import dataclasses
from typing import Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

from dist_loop import tasks
from dist_loop.core.config import Config, check_divisible
from dist_loop.core.errors import UserError
from dist_loop.core.registry import Registry
from dist_loop.data import Dataset
from dist_loop.runtime.cluster import Cluster
from dist_loop.training import optim

MODES: Registry = Registry("mode", "mode")


@dataclasses.dataclass(frozen=True)
class NoOptions:
  """A mode without options of its own."""


class Trainer(abc.ABC):
  """The inner loop of one parallel mode.

  Attributes:
    options: the mode's options (`Options`).
    task: what is learned (`dist_loop/tasks`), from the dataset.
    model: the `keras.Sequential` holding the master variables; evaluation
      and checkpoints read it.
    optimizer: the optimizer whose slots are checkpointed.
    recipe: the update's learning rate and clipping (`optim.Recipe`).
    step: int64 `tf.Variable`, the number of steps so far. A step moves it
      by one and applies one update, unless the step is skipped (its
      update was not applied: `train/skipped_steps`). In async and ps it
      counts applied updates only: a push they do not apply is no step.
    loss_scale: the float16 `DynamicLossScale`, or None.
    is_chief: whether this process writes summaries, summary.json,
      flags.txt and the kept checkpoints.
    examples_per_step: examples consumed by one step, for throughput.
    input_wait_s: the seconds the last `train(n)` call's steps waited for
      their input, or None where the mode does not measure it (goodput's
      `input` phase, `dist_loop/runtime/goodput.py`).
    xla_choice: whether `config.jit_compile` is on and why, the run's line
      (set by `build_trainer`, `modes/xla.py`).
  """

  Options = NoOptions
  # Whether the mode runs across the tasks of a TF_CONFIG cluster; the others
  # refuse a TF_CONFIG with several tasks (they would race on the workdir).
  multi_process: bool = False
  # Capabilities a mode opts into; `check_capabilities` refuses the rest.
  precisions = ("float32",)
  grad_accumulation = False
  skips_nonfinite = False  # Can drop a non-finite step (--nonfinite=skip).
  # Honours --max_loss: passes it to its step's guard (`step.above_bound`,
  # through the loop base, the async `Applier` or the ps `LockedUpdate`).
  checks_max_loss = False
  # Why --jit_compile cannot compile this mode's step over a model with
  # non-trainable state (dropout's seed, a normalisation's moving
  # statistics), `{variable}` naming the first such variable; None: it can.
  xla_state_refusal: Optional[str] = None

  model: keras.Sequential
  optimizer: keras.optimizers.Optimizer
  step: tf.Variable
  loss_scale = None
  is_chief: bool = True
  input_wait_s: Optional[float] = None
  xla_choice: str = ""

  # -- before TensorFlow starts: class methods on the config --

  @classmethod
  def num_replicas(cls, config: Config, cluster: Cluster) -> int:
    """Data-parallel replicas the global batch is split over."""
    del cluster
    return config.num_devices

  @classmethod
  def input_pipelines(cls, config: Config, cluster: Cluster) -> int:
    """Input pipelines the training input is cut into, over all processes
    (`tf.distribute.InputContext.num_input_pipelines`; TFRecord shards need
    a file for each, checked before anything is written): one per
    training process, as the loop base reads it (`stream.replica_input`).
    A mode whose workers read their own pipelines says so (async, ps)."""
    del config
    return max(cluster.num_trainers, 1)

  @classmethod
  def validate(cls, config: Config, cluster: Cluster) -> None:
    """Mode-specific rules, checked before any work. Raises UserError."""
    check_divisible(config.global_batch_size,
                    cls.num_replicas(config, cluster))

  @classmethod
  def check_capabilities(cls, config: Config) -> None:
    """Refuses run-wide features this mode did not opt into."""
    if config.precision not in cls.precisions:
      raise UserError(f"--precision={config.precision} is not supported in "
                      f"--mode={config.mode}; use one of "
                      f"{', '.join(cls.precisions)}")
    if config.nonfinite == "skip" and not cls.skips_nonfinite:
      raise UserError(f"--nonfinite=skip is not supported in --mode="
                      f"{config.mode}; use --nonfinite=rollback or raise")
    if config.max_loss and config.nonfinite == "skip":
      raise UserError("--max_loss cannot be combined with --nonfinite=skip: "
                      "a step's update is applied before its loss is "
                      "compared with the bound; use --nonfinite=rollback (to "
                      "the last checkpoint) or raise")
    if config.max_loss and not cls.checks_max_loss:
      raise UserError(f"--max_loss is not supported in --mode={config.mode}; "
                      "drop it (or use --max_loss=0)")
    why = cls.async_checkpoint_refusal(config) if (
        config.async_checkpoint) else None
    if why:
      raise UserError(f"--async_checkpoint cannot be used here: {why}. Drop "
                      "it: checkpoints are then written while training "
                      "waits")
    if config.grad_accum_steps > 1 and not cls.grad_accumulation:
      raise UserError(f"--grad_accum_steps is not supported in "
                      f"--mode={config.mode}; use --grad_accum_steps=1, or a "
                      "larger --global_batch_size")

  @classmethod
  def async_checkpoint_refusal(cls, config: Config) -> Optional[str]:
    """Why `--async_checkpoint` cannot save this mode's checkpoint items, or
    None. TensorFlow's background save copies variables to the host as it
    starts; an item that is not a variable (a replica's own state, a sharded
    slot's view) would be read later, from the writing thread."""
    del config
    return None

  @classmethod
  def xla_refusal(cls, config: Config, cluster: Cluster) -> Optional[str]:
    """Why --jit_compile cannot compile this run of the mode, from its
    configuration alone (a valid one), or None.

    `configure.validate` refuses an explicit --jit_compile with this
    message; --jit_compile=auto leaves XLA off for it (`modes/xla.py`)."""
    del config, cluster
    return None

  @classmethod
  def xla_model_refusal(cls, model: keras.Model) -> Optional[str]:
    """Why --jit_compile cannot compile this mode's step over `model`, or
    None: `xla_state_refusal` if the model has non-trainable state. A
    trainer refuses an explicit --jit_compile with it once its model is
    built (`refuse_xla`); --jit_compile=auto asks it of a throwaway build
    of the model first (`modes/xla.py`)."""
    state = model.non_trainable_variables
    if cls.xla_state_refusal is None or not state:
      return None
    return cls.xla_state_refusal.format(variable=state[0].path)

  @classmethod
  def join_cluster(cls, config: Config, cluster: Cluster) -> None:
    """Runs first in a process, before TensorFlow starts its runtime.

    A mode that spans processes joins its cluster here (a
    MultiWorkerMirroredStrategy must be built before any op runs); a process
    that only serves (a parameter server) serves here and never returns.
    """

  @classmethod
  def cluster_error(cls, config: Config, cluster: Cluster,
                    error: tf.errors.OpError) -> Optional[UserError]:
    """The one-line `UserError` that a TensorFlow runtime error raised
    anywhere in the run means in this mode (a lost peer), or None."""
    del config, cluster, error
    return None

  # -- the run --

  def __init__(self, config: Config, devices: List[str], dataset: Dataset,
               cluster: Cluster):
    require_decided_xla(config)
    self.config = config
    self.options = config.mode_options
    self.devices = devices
    self.dataset = dataset
    self.cluster = cluster
    self.task = tasks.for_dataset(dataset)
    self.recipe = optim.Recipe(config)
    self.examples_per_step = config.global_batch_size * config.grad_accum_steps

  @abc.abstractmethod
  def train(self, num_steps: int) -> Dict[str, float]:
    """Runs `num_steps` steps; returns their mean metrics (`train/...`).

    Raises:
      NonFiniteError: a step produced NaN/Inf; that step was not applied.
    """

  def refuse_xla(self, model: keras.Model) -> None:
    """Raises `xla_model_refusal(model)` as a UserError under
    --jit_compile."""
    why = self.config.jit_compile and self.xla_model_refusal(model)
    if why:
      raise UserError(why)

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

  def on_restore(self) -> None:
    """Called after a checkpoint was restored mid-run (a rollback): the
    input must restart from the restored step."""

  def on_master(self, fn, *args):
    """Runs `fn(*args)` where the master variables can be differentiated
    (mirrored variables only in replica context); returns its result."""
    return fn(*args)

  def close(self) -> None:
    """Stops threads and frees devices. Safe to call twice."""


def train_metrics(task: tasks.Task, means: Dict[str, float], *,
                  skipped: int = 0, skipped_at_end: int = 0,
                  extra: Optional[Dict[str, float]] = None
                  ) -> Dict[str, float]:
  """The end of every mode's `train(n)`, written once.

  Args:
    task: the run's task; its `report` turns the means of its metrics into
      what a user reads (a language model adds `bits_per_byte`).
    means: per-update means over the call's *applied* updates: the task's
      metrics, `grad_norm` and any mode-specific value. `grad_norm` is the
      norm of the gradient the update applied: reduced over replicas,
      micro-batches or stages, unscaled, before any learning-rate factor
      (async: one worker's, after delay compensation); local SGD applies
      no single gradient and reports `local_sgd/replica_grad_norm`
      instead. Empty when no update was applied: then the call reports
      no loss, never a 0.
    skipped: steps that advanced the counter without applying their update
      (always 0 in async and ps, whose counter counts applied updates).
    skipped_at_end: of those, the ones after the call's last applied update
      (all of them if none was applied): the controller stops a run that
      keeps skipping.
    extra: values as they are now (`loss_scale`).

  Returns:
    Flat names: `train/<name>`, or the name itself if it has a prefix
    (`local_sgd/...`); always `train/skipped_steps` and
    `train/skipped_steps_at_end`.
  """
  task_means = {k: means[k] for k in task.metric_names if k in means}
  out = dict(task.report(task_means)) if task_means else {}
  out.update((k, v) for k, v in means.items() if k not in task.metric_names)
  out.update(extra or {})
  out["skipped_steps"] = skipped
  out["skipped_steps_at_end"] = skipped_at_end
  return {(k if "/" in k else f"train/{k}"): float(v) for k, v in out.items()}


class Reporting(abc.ABC):
  """What a mode may report besides `train`'s metrics (optional).

  A trainer that also subclasses `Reporting` is asked at every log line
  for `report()` and once at the end for `summary()`.
  """

  def report(self) -> "Report":
    """Running totals, histograms and images, at a log line."""
    return Report()

  def summary(self) -> Dict[str, object]:
    """Mode-specific entries merged into summary.json."""
    return {}


@dataclasses.dataclass
class Report:
  """What a mode logs at a log line, beyond its averaged train metrics.

  scalars: values as they are now (running totals), name -> float.
  histograms: values collected since the last log line, name -> array.
  images: name -> HWC uint8 array (e.g. the pipeline timeline).
  """

  scalars: Dict[str, float] = dataclasses.field(default_factory=dict)
  histograms: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  images: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def require_decided_xla(config: Config) -> None:
  """Refuses a config whose --jit_compile is still "auto" (a truthy string
  that code testing `config.jit_compile` would take for True).

  Raises:
    TypeError: build the trainer with `modes.build_trainer`, which decides.
  """
  if not isinstance(config.jit_compile, bool):
    raise TypeError(f"jit_compile={config.jit_compile!r}: build a trainer "
                    "with modes.build_trainer, which decides "
                    "--jit_compile=auto (modes/xla.py)")
