"""Model parallelism by pipelining: chunks of layers on K devices, M micro-batches.

At start the layers' and chunks' costs are measured (`costs.py`); the
schedule (`schedule.py`, or `auto`: `planner.py`) says how many chunks the
model is cut into and which device holds each (`partition.py`); each
chunk's variables are created on its device, and every step runs the
schedule over M micro-batches of the batch (`executor.py`). Gradients are summed over the micro-batches and applied
once, so a step equals a non-pipelined step on the whole batch.

With `--num_devices=R*K` it is also data-parallel: replica r runs the whole
pipeline on devices [r*K, (r+1)*K) on its 1/R of the global batch. There is
one copy of the variables (on replica 0's devices); each chunk's gradients
are reduced over the R replicas once per step and applied once, by the one
optimizer, so checkpoints are those of the sync mode.

With `--precision=mixed_float16`, one dynamic loss scale (precision.py), on
the first device, serves all chunks and replicas: a step whose gradients
overflowed anywhere is skipped everywhere and halves the scale, as in the
sync mode, and the checkpoint holds the scale under the sync mode's name.
The inner loop and its non-finite bookkeeping are the step core's.

The inner loop is traced twice: with per-action timestamps and without
(`--pipeline_timing`). Under `log`, a `train(n)` that ends at a log line
runs n-1 untimed steps and one timed one, so only what is reported is
timed; `report()` gives its measured bubble and timeline beside the
simulator's prediction.
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
from dist_loop.modes.pipeline import costs as costs_lib
from dist_loop.modes.pipeline import partition, planner
from dist_loop.modes.pipeline import schedule as schedule_lib
from dist_loop.modes.pipeline import simulator, timeline, validation
from dist_loop.modes.pipeline.executor import PipelineExecutor, bubble
from dist_loop.modes.pipeline.options import PipelineOptions


@MODES.register("pipeline")
class PipelineTrainer(Trainer, Reporting):
  """R data-parallel replicas of a K-device micro-batched pipeline."""

  Options = PipelineOptions
  # bfloat16 needs no scaling; float16 shares one loss scale (see above).
  precisions = precision_lib.PRECISIONS
  skips_nonfinite = True  # The step core's loop drops the step.
  checks_max_loss = True
  # How layer costs are measured at start: "traced" (as the executor runs
  # them) or "eager" (faster to start, rougher; tests use it).
  cost_measurement = "traced"

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
    # The chunks are only known after measuring the layers, which needs
    # them built; so build once unplaced to measure, then build the real
    # model with each layer on its chunk's device, and give it the probe's
    # initial weights: those are what the sync mode starts from, since the
    # probe was built first after seeding.
    probe = models.build_for(config, dataset)
    initial_weights = probe.get_weights()
    microbatch = config.global_batch_size // self.replicas // m
    # Op determinism refuses timestamps: then eager, rougher costs.
    traced = self.cost_measurement == "traced" and not config.deterministic
    self.layer_costs = costs_lib.measure(
        probe.layers, dataset, microbatch,
        getattr(models.MODELS.get(config.model), "input_dtype", "float32"),
        self.task, devices[0], traced=traced)
    cores = costs_lib.shared_cores(devices, config.intra_op_threads,
                                   config.inter_op_threads, self.replicas)
    plans, skipped = planner.make_plans(
        self.options, probe.layers, self.layer_costs,
        lambda c: models.split_points_for(config.model, c, len(probe.layers)),
        measure=traced and costs_lib.chunk_measurer(
            probe.layers, dataset, microbatch, self.task, self.device_grid[0],
            self.options.recompute, cores), cores=cores)
    self.plans = plans  # Every candidate, as predicted.
    self.plan = planner.pick(plans, self.options.pipeline_memory_mb)
    del probe
    self.schedule, self.stages = self.plan.schedule, self.plan.stages
    self.schedule_name = self.plan.name
    self.ideal_bubble = simulator.ideal_bubble(self.schedule)
    placement = self.schedule.placement
    chunk_of = [s.index for s in self.stages for _ in range(s.start, s.end)]
    self.model = models.build_for(
        config, dataset,
        layer_device=lambda i: self.device_grid[0][placement[chunk_of[i]]])
    self.model.set_weights(initial_weights)
    layers = self.model.layers
    self.executor = PipelineExecutor(
        [layers[s.start:s.end] for s in self.stages], self.schedule,
        self.device_grid, m, self.task, config.global_batch_size,
        self.options.recompute)
    if [id(v) for v in self.executor.variables] != [
        id(v) for v in self.model.trainable_variables]:
      raise AssertionError("chunk variables are not in the model's order")
    with tf.device(devices[0]):
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables)
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
    self.timing = self.options.pipeline_timing
    if config.deterministic and self.timing != "never":
      logging.info("pipeline: per-action timing is off under --deterministic "
                   "(tf.timestamp is refused with op determinism): no "
                   "measured bubble or timeline, only the predicted ones")
      self.timing = "never"
    self._log_start(layers, plans, skipped)
    self.trace_counts = {False: 0, True: 0}  # Traces of each loop variant.
    self._iterator = None
    self._measured = None  # The last timed call: bubble, span, timeline.
    self._loops = {timed: self._make_loop(timed) for timed in (False, True)}

  def _log_start(self, layers, plans, skipped) -> None:
    k, m = self.num_stages, self.num_microbatches
    devices = [self.device_grid[0][d] for d in self.schedule.placement]
    logging.info("pipeline: %d device(s) x %d replica(s), %d micro-batches, "
                 "schedule %s, recompute %s, timing %s; split by %s:\n%s", k,
                 self.replicas, m, self.schedule_name, self.options.recompute,
                 self.timing, self.plan.split_how,
                 partition.format_partition(self.stages, devices))
    logging.info("pipeline schedules, predicted from the measured costs:\n%s",
                 planner.table(plans, self.plan, skipped))
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

  @property
  def trace_count(self) -> int:
    return sum(self.trace_counts.values())

  # -- one step, and the inner loop: num_steps of them in one tf.function --

  def _step_fn(self, batch, timed: bool):
    """One pipelined step, applied only if its gradients are all finite.

    Returns (metrics, ok, carry) as `step_core.run_steps` wants; timed,
    the carry is the step's (starts, ends).
    """
    x, y = batch
    scale = (None if self.loss_scale is None
             else self.loss_scale.scale.read_value())  # One for all chunks.
    out = self.executor.step(x, y, scale, timed)
    grads, ok = precision_lib.unscale_and_apply(
        self.optimizer, out["grads"], self.executor.variables,
        self.loss_scale, scale)
    metrics = {**out["metrics"], "grad_norm": tf.linalg.global_norm(grads)}
    if not timed:
      return metrics, ok, ()
    starts, ends = out["starts"], out["ends"]
    metrics["bubble"] = tf.cast(bubble(starts, ends), tf.float32)
    metrics["span"] = tf.cast(tf.reduce_max(ends) - tf.reduce_min(starts),
                              tf.float32)
    return metrics, ok, (starts, ends)

  def _make_loop(self, timed: bool):
    keys = tuple(self.task.metric_names) + ("grad_norm",)
    carry = ()
    if timed:
      keys += ("bubble", "span")
      width = max(len(row) for row in self.schedule.devices)
      shape = [self.replicas, self.num_stages, width]
      carry = (tf.zeros(shape, tf.float64), tf.zeros(shape, tf.float64))

    def loop(iterator, num_steps):
      self.trace_counts[timed] += 1  # Python side effect: once per trace.
      return step_core.run_steps(
          lambda batch: self._step_fn(batch, timed), iterator, num_steps,
          self.step, keys=keys, nonfinite=self.config.nonfinite,
          loss_scale=self.loss_scale, carry=carry,
          max_loss=self.config.max_loss)

    return tf.function(loop)

  def _segments(self, start: int, num_steps: int):
    """[(steps, timed)]: which loop variant runs which steps of a call."""
    if self.timing != "log":
      return [(num_steps, self.timing == "every")]
    end = start + num_steps
    if end % self.config.log_every and end != self.config.train_steps:
      return [(num_steps, False)]
    return [(n, timed) for n, timed in ((num_steps - 1, False), (1, True))
            if n]

  def train(self, num_steps: int) -> Dict[str, float]:
    if self._iterator is None:  # Built lazily: resumes at the restored step.
      fn = train_dataset_fn(self.dataset.train_x, self.dataset.train_y,
                            self.config.global_batch_size, self.config.seed,
                            start_step=int(self.step.numpy()))
      # One stream of whole global batches; the executor cuts it.
      self._iterator = iter(fn(tf.distribute.InputContext()))
    names = tuple(self.task.metric_names) + ("grad_norm",)
    sums = dict.fromkeys(names, 0.0)
    applied = skipped = 0
    for count, timed in self._segments(int(self.step.numpy()), num_steps):
      means, bad_step, carry = self._loops[timed](
          self._iterator, tf.constant(count, tf.int64))
      if int(bad_step) >= 0:
        raise NonFiniteError(int(bad_step))
      part_skipped = int(means["skipped_steps"])
      part_applied = count - part_skipped
      for name in names:
        sums[name] += float(means[name]) * part_applied
      applied += part_applied
      skipped += part_skipped
      if timed and part_applied:
        self._measured = {"bubble": float(means["bubble"]),
                          "step_ms": 1e3 * float(means["span"]),
                          "starts": carry[0].numpy()[0],
                          "ends": carry[1].numpy()[0]}
    means = {k: v / max(applied, 1) for k, v in sums.items()}
    task_means = self.task.report(
        {k: means[k] for k in self.task.metric_names})
    metrics = {f"train/{k}": v for k, v in task_means.items()}
    metrics["train/grad_norm"] = means["grad_norm"]
    metrics["train/skipped_steps"] = float(skipped)
    if self.loss_scale is not None:
      metrics["train/loss_scale"] = float(self.loss_scale.scale.numpy())
    return metrics

  # -- reporting --

  def timeline_bars(self):
    """Replica 0's last measured step as Gantt bars, or None before any."""
    if self._measured is None:
      return None
    return timeline.bars_from_timestamps(
        self.schedule, self._measured["starts"], self._measured["ends"])

  def report(self) -> Report:
    """Predicted and measured bubble and step time, and the two timelines
    (measured above predicted, on one time scale)."""
    predicted = self.plan.prediction
    scalars = {"pipeline/bubble_predicted": predicted.bubble,
               "pipeline/step_ms_predicted": 1e3 * predicted.step_time,
               "pipeline/bubble_formula": self.ideal_bubble}
    images = []
    bars = self.timeline_bars()
    title = (f"{self.schedule_name} K={self.num_stages} "
             f"M={self.num_microbatches}")
    if bars is not None:
      scalars["pipeline/bubble_measured"] = self._measured["bubble"]
      scalars["pipeline/step_ms"] = self._measured["step_ms"]
      images.append((bars, f"{title} MEASURED "
                           f"{self._measured['step_ms']:.1f} MS"))
    images.append((predicted.bars, f"{title} PREDICTED "
                                   f"{1e3 * predicted.step_time:.1f} MS"))
    image = timeline.render_many(images, self.schedule)
    return Report(scalars=scalars, images={"pipeline/timeline": image})

  def summary(self) -> Dict[str, object]:
    predicted = self.plan.prediction
    return {
        "pipeline_stages": self.num_stages,
        "pipeline_replicas": self.replicas,
        "pipeline_microbatches": self.num_microbatches,
        "pipeline_schedule": self.schedule_name,
        "pipeline_virtual_stages": self.schedule.virtual_stages,
        "pipeline_split": [list(s.layer_names) for s in self.stages],
        "pipeline_bubble_formula": self.ideal_bubble,
        "pipeline_bubble_predicted": predicted.bubble,
        "pipeline_step_ms_predicted": 1e3 * predicted.step_time,
        "pipeline_peak_mb_predicted": predicted.peak_mb,
    }
