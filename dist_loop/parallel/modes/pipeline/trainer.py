"""Pipeline model parallelism: chunks of layers on K devices, M micro-batches.

A run is planned before it is built (`planner.plan`): the layers' costs are
measured, the schedule chosen (`--pipeline_schedule`, or the fastest
predicted for `auto`) and the layers cut into its chunks. The trainer
builds the model with each chunk's variables on its device (a stage), and
every step runs the schedule over M micro-batches of the batch
(`executor.py`). Gradients are summed over the micro-batches and applied
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

The loop around the step, its input and its metrics are the loop base's
(`modes/loop.py`) without a strategy: the executor places every op itself,
and the R replicas live inside one step, whose results are already the
update's means. The step has two variants, each its own traced loop: with
per-action timestamps and without (`--pipeline_timing`). Under `log`, a
`train(n)` runs n-1 untimed steps and one timed one (`loop_begin`): the
controller ends a call where an action (the log line among them) runs, so
the step a report follows is timed, and the others carry no timestamp ops.
The timed step leaves its timestamps in two variables; `report()` gives the
last one's bubble and timeline beside the simulator's prediction.
"""

import dataclasses
from typing import Dict

import tensorflow as tf
from absl import logging

from dist_loop import models
from dist_loop.parallel.modes.base import MODES, Report, Reporting
from dist_loop.parallel.modes.loop import LoopTrainer, StepResult
from dist_loop.parallel.modes.pipeline import partition, planner
from dist_loop.parallel.modes.pipeline import schedule as schedule_lib
from dist_loop.parallel.modes.pipeline import simulator, timeline, validation
from dist_loop.parallel.modes.pipeline.executor import PipelineExecutor, bubble
from dist_loop.parallel.modes.pipeline.options import PipelineOptions
from dist_loop.training import optim
from dist_loop.training import precision as precision_lib

UNTIMED, TIMED = "untimed", "timed"  # The loop variants.


@MODES.register("pipeline")
class PipelineTrainer(LoopTrainer, Reporting):
  """R data-parallel replicas of a K-device micro-batched pipeline."""

  Options = PipelineOptions
  # bfloat16 needs no scaling; float16 shares one loss scale (see above).
  precisions = precision_lib.PRECISIONS
  skips_nonfinite = True
  checks_max_loss = True
  # How layer costs are measured at start: "traced" (as the executor runs
  # them) or "eager" (faster to start, rougher; tests use it).
  cost_measurement = "traced"
  xla_state_refusal = (
      "--mode=pipeline --jit_compile: the model has non-trainable state "
      "({variable}, ...), which a compiled chunk cannot read from another "
      "device; drop --jit_compile, or use --mode=sync")

  @classmethod
  def num_replicas(cls, config, cluster) -> int:
    del cluster
    return max(config.num_devices // config.mode_options.num_stages, 1)

  @classmethod
  def validate(cls, config, cluster) -> None:
    validation.check(config, cls.num_replicas(config, cluster))

  @classmethod
  def xla_refusal(cls, config, cluster):
    return validation.xla_refusal(config, cls.num_replicas(config, cluster))

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    k, m = self.options.num_stages, self.options.num_microbatches
    self.num_stages, self.num_microbatches = k, m
    self.replicas = self.num_replicas(config, cluster)
    self.device_grid = [devices[r * k:(r + 1) * k]
                        for r in range(self.replicas)]
    plan = planner.plan(config, dataset, devices,
                        traced=self.cost_measurement == "traced")
    chosen = plan.chosen
    self.schedule, self.chunk_spans = chosen.schedule, chosen.spans
    self.schedule_name = chosen.name
    self.ideal_bubble = simulator.ideal_bubble(self.schedule)
    self.model = self._placed_model(plan.initial_weights)
    self.refuse_xla(self.model)
    # The weights are the model's now; the plan keeps the rest for reports.
    self.plan = dataclasses.replace(plan, initial_weights=None)
    self.executor = PipelineExecutor(
        [self.model.layers[s.start:s.end] for s in self.chunk_spans],
        self.schedule, self.device_grid, m, self.task,
        config.global_batch_size, self.options.recompute,
        config.jit_compile)
    if [id(v) for v in self.executor.variables] != [
        id(v) for v in self.model.trainable_variables]:
      raise AssertionError("chunk variables are not in the model's order")
    with tf.device(devices[0]):
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables,
                                  config.weight_decay)
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
    self.timing = self.options.pipeline_timing
    if config.deterministic and self.timing != "never":
      logging.info("pipeline: per-action timing is off under --deterministic "
                   "(tf.timestamp is refused with op determinism): no "
                   "measured bubble or timeline, only the predicted ones")
      self.timing = "never"
    self._measured = None  # The last timed step: bubble, span, timeline.
    width = max(len(row) for row in self.schedule.devices)
    with tf.device(devices[0]):  # A timed step's (starts, ends).
      self._stamps = tuple(
          tf.Variable(tf.zeros([self.replicas, k, width], tf.float64),
                      trainable=False, name=name)
          for name in ("stamp_starts", "stamp_ends"))
    self._log_start()

  def _placed_model(self, weights):
    """The model with each layer on its chunk's device (replica 0's), with
    the probe's `weights`."""
    placement = self.schedule.placement
    chunk_of = [s.index for s in self.chunk_spans
                for _ in range(s.start, s.end)]
    model = models.build_for(
        self.config, self.dataset,
        layer_device=lambda i: self.device_grid[0][placement[chunk_of[i]]])
    model.set_weights(weights)
    return model

  def _log_start(self) -> None:
    devices = [self.device_grid[0][d] for d in self.schedule.placement]
    logging.info("pipeline: %d device(s) x %d replica(s), %d micro-batches, "
                 "schedule %s, recompute %s, timing %s; split by %s:\n%s",
                 self.num_stages, self.replicas, self.num_microbatches,
                 self.schedule_name, self.options.recompute, self.timing,
                 self.plan.chosen.split_how,
                 partition.format_partition(self.chunk_spans, devices))
    logging.info("pipeline schedule:\n%s",
                 schedule_lib.format_schedule(self.schedule))

  # -- the step, for the loop base --

  def loop_begin(self, start, num_steps):
    """Which loop variant runs which steps of a call (`--pipeline_timing`):
    under `log`, only the call's last step."""
    del start
    if self.timing != "log":
      return [(num_steps, TIMED if self.timing == "every" else UNTIMED)]
    return [(n, v) for n, v in ((num_steps - 1, UNTIMED), (1, TIMED)) if n]

  def replica_step(self, batch, variant):
    """One pipelined step of every replica, applied only if its gradients
    are all finite; timed, its (starts, ends) go to `self._stamps`."""
    x, y = batch
    timed = variant == TIMED
    scale = (None if self.loss_scale is None
             else self.loss_scale.scale.read_value())  # One for all chunks.
    out = self.executor.step(x, y, scale, timed)
    # The norm spans every stage: the gradients of all chunks.
    ok, means = precision_lib.unscale_and_apply(
        self.optimizer, out["grads"], self.executor.variables,
        self.loss_scale, scale, self.recipe, self.step)
    if timed:
      for stamps, value in zip(self._stamps, (out["starts"], out["ends"])):
        stamps.assign(value)
    return StepResult(out["metrics"], ok, means)

  def loop_end(self, end):
    """The last timed step's bubble, span and timestamps, if a timed step
    of this call was applied."""
    if not end.applied.get(TIMED):
      return
    starts, ends = (v.read_value() for v in self._stamps)
    span = tf.reduce_max(ends) - tf.reduce_min(starts)
    self._measured = {"bubble": float(bubble(starts, ends)),
                      "step_ms": 1e3 * float(span),
                      "starts": starts.numpy()[0], "ends": ends.numpy()[0]}

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
    predicted = self.plan.chosen.prediction
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
    predicted = self.plan.chosen.prediction
    return {
        "pipeline_stages": self.num_stages,
        "pipeline_replicas": self.replicas,
        "pipeline_microbatches": self.num_microbatches,
        "pipeline_schedule": self.schedule_name,
        "pipeline_virtual_stages": self.schedule.virtual_stages,
        "pipeline_split": [list(s.layer_names) for s in self.chunk_spans],
        "pipeline_bubble_formula": self.ideal_bubble,
        "pipeline_bubble_predicted": predicted.bubble,
        "pipeline_step_ms_predicted": 1e3 * predicted.step_time,
        "pipeline_peak_mb_predicted": predicted.peak_mb,
    }
