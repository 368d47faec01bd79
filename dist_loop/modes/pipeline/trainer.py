"""Model parallelism by pipelining: K stages on K devices, M micro-batches.

The model's ordered layers are cut into K stages (`partition.py`), each
stage's variables are created on its own device, and every step runs a
schedule (`schedule.py`: GPipe or 1F1B, as data) over M micro-batches of the
batch (`executor.py`). Gradients are summed over the micro-batches and
applied once, so a step equals a non-pipelined step on the whole batch.

With `--num_devices=R*K` it is also data-parallel: replica r runs the whole
pipeline on devices [r*K, (r+1)*K) on its 1/R of the global batch. There is
one copy of the variables (on replica 0's devices); each stage's gradients
are reduced over the R replicas once per step and applied once, by the one
optimizer, so checkpoints are those of the sync mode.

With `--precision=mixed_float16`, one dynamic loss scale (precision.py), on
the first device, serves all stages and replicas: a step whose gradients
overflowed anywhere is skipped on every stage and halves the scale, as in
the sync mode, and the checkpoint holds the scale under the sync mode's name.
The inner loop and its non-finite bookkeeping are the step core's
(`dist_loop.step.run_steps`), with the step's timeline as its carry.
"""

from typing import Dict

import keras
import tensorflow as tf
from absl import logging

from dist_loop import models, optim
from dist_loop import precision as precision_lib
from dist_loop import step as step_core
from dist_loop.data import train_dataset_fn
from dist_loop.errors import NonFiniteError
from dist_loop.modes.base import MODES, Report, Reporting, Trainer
from dist_loop.modes.pipeline import partition
from dist_loop.modes.pipeline import schedule as schedule_lib
from dist_loop.modes.pipeline import timeline, validation
from dist_loop.modes.pipeline.executor import PipelineExecutor, bubble
from dist_loop.modes.pipeline.options import PipelineOptions


@MODES.register("pipeline")
class PipelineTrainer(Trainer, Reporting):
  """R data-parallel replicas of a K-stage micro-batched pipeline."""

  Options = PipelineOptions
  # bfloat16 needs no scaling; float16 shares one loss scale (see above).
  precisions = precision_lib.PRECISIONS
  skips_nonfinite = True  # The step core's loop drops the step.

  @classmethod
  def num_replicas(cls, config, cluster) -> int:
    del cluster
    return max(config.num_devices // config.mode_options.num_stages, 1)

  @classmethod
  def validate(cls, config, cluster) -> None:
    validation.check(config, cls.num_replicas(config, cluster))

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    k, m = self.options.num_stages, self.options.num_microbatches
    self.num_stages, self.num_microbatches = k, m
    self.replicas = self.num_replicas(config, cluster)
    self.device_grid = [devices[r * k:(r + 1) * k]
                        for r in range(self.replicas)]
    # The stage of each layer is only known after timing the layers, which
    # needs them built; so build once unplaced to measure, then build the
    # real model with each layer on its stage's device, and give it the
    # probe's initial weights: those are what the sync mode starts from,
    # since the probe was built first after seeding.
    probe = models.build_for(config, dataset)
    initial_weights = probe.get_weights()
    self.stages, self.split_how = partition.choose(
        self.options.stage_split, probe.layers, k, self.options.split_points,
        models.split_points_for(config.model, k, len(probe.layers)),
        dataset.input_shape, config.global_batch_size // self.replicas // m,
        getattr(models.MODELS.get(config.model), "input_dtype", "float32"))
    del probe
    stage_of = [s.index for s in self.stages for _ in range(s.start, s.end)]
    self.model = models.build_for(
        config, dataset,
        layer_device=lambda i: self.device_grid[0][stage_of[i]])
    self.model.set_weights(initial_weights)
    layers = self.model.layers
    self.schedule = schedule_lib.make(self.options.pipeline_schedule, k, m)
    self.executor = PipelineExecutor(
        [layers[s.start:s.end] for s in self.stages], self.schedule,
        self.device_grid, m, self.task, config.global_batch_size,
        self.options.recompute)
    if [id(v) for v in self.executor.variables] != [
        id(v) for v in self.model.trainable_variables]:
      raise AssertionError("stage variables are not in the model's order")
    with tf.device(devices[0]):
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables)
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
    self._log_start(layers)
    self.trace_count = 0
    self._iterator = None
    self._last_timeline = None  # Replica 0's (starts, ends) of the last step.
    self._keys = tuple(self.task.metric_names) + ("grad_norm", "bubble",
                                                  "span")
    self._loop = tf.function(self._loop_fn)

  def _log_start(self, layers) -> None:
    k, m = self.num_stages, self.num_microbatches
    logging.info("pipeline: %d stage(s) x %d replica(s), %d micro-batches, "
                 "schedule %s, recompute %s; split by %s:\n%s", k,
                 self.replicas, m, self.options.pipeline_schedule,
                 self.options.recompute, self.split_how,
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

  def _step_fn(self, batch):
    """One pipelined step, applied only if its gradients are all finite.

    Returns (metrics, ok, (starts, ends)), as `step_core.run_steps` wants.
    """
    x, y = batch
    scale = (None if self.loss_scale is None
             else self.loss_scale.scale.read_value())  # One for all stages.
    out = self.executor.step(x, y, scale)
    grads, ok = precision_lib.unscale_and_apply(
        self.optimizer, out["grads"], self.executor.variables,
        self.loss_scale, scale)
    starts, ends = out["starts"], out["ends"]
    metrics = {**out["metrics"],
               "grad_norm": tf.linalg.global_norm(grads),
               "bubble": tf.cast(bubble(starts, ends), tf.float32),
               "span": tf.cast(tf.reduce_max(ends) - tf.reduce_min(starts),
                               tf.float32)}
    return metrics, ok, (starts, ends)

  def _loop_fn(self, iterator, num_steps):
    self.trace_count += 1  # Python side effect: runs once per trace.
    shape = [self.replicas, self.num_stages, 2 * self.num_microbatches]
    return step_core.run_steps(
        self._step_fn, iterator, num_steps, self.step, keys=self._keys,
        nonfinite=self.config.nonfinite, loss_scale=self.loss_scale,
        carry=(tf.zeros(shape, tf.float64), tf.zeros(shape, tf.float64)))

  def train(self, num_steps: int) -> Dict[str, float]:
    if self._iterator is None:  # Built lazily: resumes at the restored step.
      fn = train_dataset_fn(self.dataset.train_x, self.dataset.train_y,
                            self.config.global_batch_size, self.config.seed,
                            start_step=int(self.step.numpy()))
      # One stream of whole global batches; the executor cuts it.
      self._iterator = iter(fn(tf.distribute.InputContext()))
    means, bad_step, (starts, ends) = self._loop(
        self._iterator, tf.constant(num_steps, tf.int64))
    if int(bad_step) >= 0:
      raise NonFiniteError(int(bad_step))
    self._last_timeline = (starts.numpy()[0], ends.numpy()[0])
    task_means = self.task.report(
        {k: float(means[k]) for k in self.task.metric_names})
    metrics = {f"train/{k}": v for k, v in task_means.items()}
    metrics["train/grad_norm"] = float(means["grad_norm"])
    metrics["train/skipped_steps"] = float(means["skipped_steps"])
    if self.loss_scale is not None:
      metrics["train/loss_scale"] = float(means["loss_scale"])
    metrics["pipeline/bubble_measured"] = float(means["bubble"])
    metrics["pipeline/bubble_formula"] = schedule_lib.bubble_formula(
        self.num_stages, self.num_microbatches)
    metrics["pipeline/step_ms"] = 1e3 * float(means["span"])
    return metrics

  # -- reporting --

  def timeline_bars(self):
    """Replica 0's last measured step as Gantt bars, or None before any."""
    if self._last_timeline is None:
      return None
    return timeline.bars_from_timestamps(self.schedule, *self._last_timeline)

  def report(self) -> Report:
    """The timeline of the last step, as an image."""
    bars = self.timeline_bars()
    if bars is None:
      return Report()
    span_ms = 1e3 * max(end for _, _, _, end in bars)
    title = (f"{self.options.pipeline_schedule} K={self.num_stages} "
             f"M={self.num_microbatches} {span_ms:.1f} MS")
    image = timeline.render(bars, self.num_stages, title=title)
    return Report(images={"pipeline/timeline": image})

  def summary(self) -> Dict[str, object]:
    return {
        "pipeline_stages": self.num_stages,
        "pipeline_replicas": self.replicas,
        "pipeline_microbatches": self.num_microbatches,
        "pipeline_schedule": self.options.pipeline_schedule,
        "pipeline_split": [list(s.layer_names) for s in self.stages],
        "pipeline_bubble_formula": schedule_lib.bubble_formula(
            self.num_stages, self.num_microbatches),
    }
