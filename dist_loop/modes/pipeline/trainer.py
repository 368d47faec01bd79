"""Model parallelism by pipelining: K stages on K devices, M micro-batches.

The model's ordered layers are cut into K stages (`pipeline/partition.py`),
each stage's variables are created on its own device, and every step runs a
schedule (`pipeline/schedule.py`: GPipe or 1F1B, as data) over M
micro-batches of the batch (`pipeline/executor.py`). Gradients are summed
over the micro-batches and applied once, so a step equals a non-pipelined
step on the whole batch.

With `--num_devices=R*K` it is also data-parallel: replica r runs the whole
pipeline on devices [r*K, (r+1)*K) on its 1/R of the global batch. There is
one copy of the variables (on replica 0's devices); each stage's gradients
are reduced over the R replicas once per step and applied once, by the one
optimizer, so checkpoints are those of the sync mode.

With `--precision=mixed_float16`, one dynamic loss scale (precision.py),
next to the optimizer on the first device, serves all stages and replicas:
each step reads it once, the last stages start their backward pass from
d(loss * scale), so the float16 activation gradients sent between stages
are scaled, and the reduced gradients are unscaled in float32 before the
update. A step whose gradients overflowed is skipped (the step counter
still advances) and halves the scale, as in the sync mode; the checkpoint
holds the scale under the sync mode's name.
"""

from typing import Dict

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from dist_loop import models, optim
from dist_loop import precision as precision_lib
from dist_loop.config import Config, check_divisible
from dist_loop.data import train_dataset_fn
from dist_loop.errors import NonFiniteError, UserError
from dist_loop.modes.base import MODES, Trainer
from dist_loop.modes.pipeline import partition
from dist_loop.modes.pipeline import schedule as schedule_lib
from dist_loop.modes.pipeline import timeline
from dist_loop.modes.pipeline.executor import RECOMPUTE, PipelineExecutor, bubble

STAGE_SPLITS = ("auto", "params", "explicit")


@MODES.register("pipeline")
class PipelineTrainer(Trainer):
  """R data-parallel replicas of a K-stage micro-batched pipeline."""

  # bfloat16 needs no scaling; float16 shares one loss scale (see above).
  precisions = precision_lib.PRECISIONS

  @classmethod
  def num_replicas(cls, config: Config) -> int:
    return max(config.num_devices // config.num_stages, 1)

  @classmethod
  def validate_config(cls, config: Config) -> None:
    k, m = config.num_stages, config.num_microbatches
    if k < 1 or m < 1:
      raise UserError("--num_stages and --num_microbatches must be >= 1")
    if k > config.num_devices:
      raise UserError(
          f"--num_stages={k} needs {k} devices but --num_devices="
          f"{config.num_devices}; use --num_devices={k} (or R*{k} for R "
          "data-parallel pipelines) or fewer stages")
    if config.num_devices % k:
      lower = config.num_devices - config.num_devices % k
      raise UserError(
          f"--num_devices={config.num_devices} is not a multiple of "
          f"--num_stages={k}; use --num_devices={lower} or {lower + k}")
    replicas = cls.num_replicas(config)
    check_divisible(config.global_batch_size, replicas)
    per_replica = config.global_batch_size // replicas
    if per_replica % m:
      fits = [d for d in range(1, per_replica + 1) if per_replica % d == 0]
      near = ([d for d in fits if d < m][-1:]
              + [d for d in fits if d > m][:1])
      raise UserError(
          f"--num_microbatches={m} does not divide the per-replica batch "
          f"{per_replica} (--global_batch_size={config.global_batch_size} "
          f"over {replicas} replica(s)); use --num_microbatches="
          f"{' or '.join(map(str, sorted(near)))}")
    schedule_lib.SCHEDULES.get(config.pipeline_schedule)
    for name, value, choices in (("stage_split", config.stage_split,
                                  STAGE_SPLITS),
                                 ("recompute", config.recompute, RECOMPUTE)):
      if value not in choices:
        raise UserError(f"unknown --{name}={value!r}; choose one of: "
                        f"{', '.join(choices)}")
    points = partition.parse_split_points(config.split_points)
    if points and config.stage_split != "explicit":
      raise UserError("--split_points is only read with "
                      "--stage_split=explicit; add it or drop --split_points")
    num_layers = _count_layers(config.model)
    if num_layers is not None and k > num_layers:
      raise UserError(f"--num_stages={k} but model {config.model!r} has "
                      f"{num_layers} layers; use at most {num_layers} stages")
    if config.stage_split == "explicit":
      if not points:
        raise UserError("--stage_split=explicit needs --split_points, "
                        f"{k - 1} layer indices such as "
                        f"{','.join(str(i + 1) for i in range(k - 1))}")
      if num_layers is not None:
        partition.check_split_points(points, k, num_layers)

  def __init__(self, config, devices, split):
    super().__init__(config, devices, split)
    k, m = config.num_stages, config.num_microbatches
    self.num_stages, self.num_microbatches = k, m
    self.replicas = self.num_replicas(config)
    self.device_grid = [devices[r * k:(r + 1) * k]
                        for r in range(self.replicas)]
    builder = models.MODELS.get(config.model)
    # The stage of each layer is only known after timing the layers, which
    # needs them built; so build once unplaced to measure, then build the
    # real model with each layer on its stage's device, and give it the
    # probe's initial weights: those are what the sync mode starts from,
    # since the probe was built first after seeding.
    probe = models.build(config.model, split.input_shape, split.num_classes,
                         precision=config.precision)
    initial_weights = probe.get_weights()
    self.stages, how = partition.choose(
        config.stage_split, probe.layers, k, config.split_points,
        getattr(builder, "split_points", None), split.input_shape,
        config.global_batch_size // self.replicas // m)
    del probe
    stage_of = [s.index for s in self.stages for _ in range(s.start, s.end)]
    self.model = models.build(
        config.model, split.input_shape, split.num_classes,
        layer_device=lambda i: self.device_grid[0][stage_of[i]],
        precision=config.precision)
    self.model.set_weights(initial_weights)
    if self.model.losses:
      raise UserError(f"model {config.model!r} has regularisation losses, "
                      "which the pipeline mode does not support")
    layers = self.model.layers
    self.schedule = schedule_lib.make(config.pipeline_schedule, k, m)
    self.executor = PipelineExecutor(
        [layers[s.start:s.end] for s in self.stages], self.schedule,
        self.device_grid, m, config.global_batch_size, config.recompute)
    if [id(v) for v in self.executor.variables] != [
        id(v) for v in self.model.trainable_variables]:
      raise AssertionError("stage variables are not in the model's order")
    with tf.device(devices[0]):
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables)
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
    self._log_start(how, layers)
    self.trace_count = 0
    self._iterator = None
    self._last_timeline = None
    self._loop = tf.function(self._loop_fn)

  def _log_start(self, how, layers) -> None:
    k, m = self.num_stages, self.num_microbatches
    logging.info("pipeline: %d stage(s) x %d replica(s), %d micro-batches, "
                 "schedule %s, recompute %s; split by %s:\n%s", k,
                 self.replicas, m, self.config.pipeline_schedule,
                 self.config.recompute, how,
                 partition.format_partition(self.stages, self.device_grid[0]))
    logging.info("pipeline schedule:\n%s",
                 schedule_lib.format_schedule(self.schedule))
    if m < k:
      logging.warning(
          "--num_microbatches=%d < --num_stages=%d: the bubble (K-1)/(M+K-1) "
          "is %.0f%% of each step; use M >= 4K (--num_microbatches=%d)", m, k,
          100 * schedule_lib.bubble_formula(k, m), 4 * k)
    if any(isinstance(l, keras.layers.BatchNormalization) for l in layers):
      logging.warning(
          "the model has BatchNormalization: in pipeline mode its batch "
          "statistics are per micro-batch (%d examples), not per mini-batch, "
          "and its moving averages are updated once per micro-batch",
          self.config.global_batch_size // self.replicas // m)

  def on_restore(self):
    self._iterator = None  # Rebuilt from the restored step.

  # -- one step, and the inner loop: num_steps of them in one tf.function --

  def _step_fn(self, x, y):
    """One pipelined step, applied only if its gradients are all finite.

    Returns the executor's outputs with `grads` unscaled, and `ok`.
    """
    scale = (None if self.loss_scale is None
             else self.loss_scale.scale.read_value())  # One for all stages.
    out = self.executor.step(x, y, scale)
    grads, ok = precision_lib.unscale_and_apply(
        self.optimizer, out["grads"], self.executor.variables,
        self.loss_scale, scale)
    return {**out, "grads": grads, "ok": ok}

  def _loop_fn(self, iterator, num_steps):
    self.trace_count += 1  # Python side effect: runs once per trace.
    shape = [self.replicas, self.num_stages, 2 * self.num_microbatches]
    total = {"loss": 0.0, "accuracy": 0.0, "grad_norm": 0.0, "bubble": 0.0,
             "span": 0.0}
    done = tf.constant(0, tf.int64)
    skipped = tf.constant(0, tf.int64)
    bad_step = tf.constant(-1, tf.int64)
    starts = tf.zeros(shape, tf.float64)
    ends = tf.zeros(shape, tf.float64)
    # With loss scaling, an overflow is expected now and then: that step is
    # skipped and the scale drops. Any other non-finite step stops the loop
    # and is raised.
    may_skip = self.loss_scale is not None
    for _ in tf.range(num_steps):
      x, y = next(iterator)
      out = self._step_fn(x, y)
      self.step.assign_add(1)
      loss, ok, grads = out["loss"], out["ok"], out["grads"]
      if not tf.math.is_finite(loss) or not (ok or may_skip):
        bad_step = self.step.read_value()
        break
      done += 1
      starts, ends = out["starts"], out["ends"]  # It ran: its timeline.
      if not ok:
        skipped += 1
        continue
      span = tf.reduce_max(ends) - tf.reduce_min(starts)
      total = {
          "loss": total["loss"] + loss,
          "accuracy": total["accuracy"]
                      + out["correct"] / self.config.global_batch_size,
          "grad_norm": total["grad_norm"] + tf.linalg.global_norm(grads),
          "bubble": total["bubble"] + tf.cast(bubble(starts, ends),
                                              tf.float32),
          "span": total["span"] + tf.cast(span, tf.float32),
      }
    n = tf.maximum(tf.cast(done - skipped, tf.float32), 1.0)
    means = {k: v / n for k, v in total.items()}
    if self.loss_scale is not None:
      means["skipped_steps"] = tf.cast(skipped, tf.float32)
      means["loss_scale"] = self.loss_scale.scale.read_value()
    return means, bad_step, starts, ends

  def train(self, num_steps: int) -> Dict[str, float]:
    if self._iterator is None:  # Built lazily: resumes at the restored step.
      fn = train_dataset_fn(self.split.train_x, self.split.train_y,
                            self.config.global_batch_size, self.config.seed,
                            start_step=int(self.step.numpy()))
      # One stream of whole global batches; the executor cuts it.
      self._iterator = iter(fn(tf.distribute.InputContext()))
    means, bad_step, starts, ends = self._loop(
        self._iterator, tf.constant(num_steps, tf.int64))
    if int(bad_step) >= 0:
      raise NonFiniteError(int(bad_step))
    self._last_timeline = (starts.numpy()[0], ends.numpy()[0])
    k, m = self.num_stages, self.num_microbatches
    metrics = {
        "train/loss": float(means["loss"]),
        "train/accuracy": float(means["accuracy"]),
        "train/grad_norm": float(means["grad_norm"]),
        "train/learning_rate": float(
            tf.convert_to_tensor(self.optimizer.learning_rate)),
        "pipeline/bubble_measured": float(means["bubble"]),
        "pipeline/bubble_formula": schedule_lib.bubble_formula(k, m),
        "pipeline/step_ms": 1e3 * float(means["span"]),
    }
    if self.loss_scale is not None:
      metrics["train/skipped_steps"] = float(means["skipped_steps"])
      metrics["train/loss_scale"] = float(means["loss_scale"])
    return metrics

  # -- what the controller logs besides scalars --

  def timeline_bars(self):
    """Replica 0's last measured step as Gantt bars, or None before any."""
    if self._last_timeline is None:
      return None
    return timeline.bars_from_timestamps(self.schedule, *self._last_timeline)

  def images(self) -> Dict[str, np.ndarray]:
    bars = self.timeline_bars()
    if bars is None:
      return {}
    span_ms = 1e3 * max(end for _, _, _, end in bars)
    title = (f"{self.config.pipeline_schedule} K={self.num_stages} "
             f"M={self.num_microbatches} {span_ms:.1f} MS")
    return {"pipeline/timeline": timeline.render(bars, self.num_stages,
                                                 title=title)}


def _count_layers(model_name: str):
  """The number of layers of a registered model, without building it.

  Builders here do not depend on the input shape for their layer list; if
  one does and fails on a placeholder, the check waits for the real build.
  """
  builder = models.MODELS.get(model_name)
  size = getattr(builder, "image_size", None)
  shape = (size, size, 1) if size else (1,)
  try:
    return len(builder(shape, 10))
  except Exception:  # pylint: disable=broad-except
    return None
