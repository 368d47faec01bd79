"""Synchronous data parallelism: MirroredStrategy and one explicit all-reduce.

Each replica differentiates its share of the step's mean loss (the step
core, `dist_loop/training/step.py`: a replica's `grad_accum_steps` micro-batches
are `replicas x grad_accum_steps` contributors), so that the SUM over replicas
of its gradients is the gradient of the global-batch mean. The step has one
path: the gradients go to the run's reducer (`--reducer`,
`dist_loop/parallel/reducers`: replicated with a compressor, or sharded by
a ZeRO stage), which all-reduces them exactly once, in replica context, and
applies them with `optim.apply_reduced`, which does not reduce again. The
reducer owns its state, checkpoint entries and byte/memory report. The loop around the step, its input and its
metrics are the loop base's (`modes/loop.py`). A compressor's warm-up
(`exact_steps`) is its own traced loop (`loop_begin`): the steps before it
sum the gradients exactly.
"""

from typing import Dict

import tensorflow as tf

from dist_loop import models
from dist_loop.parallel import compression
from dist_loop.parallel import straggler as straggler_lib
from dist_loop.parallel.modes.base import MODES, Report, Reporting
from dist_loop.parallel.modes.loop import LoopTrainer, StepResult
from dist_loop.parallel.modes.mirrored import Mirrored
from dist_loop.parallel.modes.sync.options import SyncOptions
from dist_loop.parallel.reducers import REDUCERS
from dist_loop.runtime import user_code
from dist_loop.training import precision as precision_lib
from dist_loop.training import step as step_core

_EXACT, _COMPRESSED = "exact", "compressed"  # The loop variants.


@MODES.register("sync")
class SyncTrainer(Mirrored, LoopTrainer, Reporting):
  """`strategy.run(replica_step)` inside the loop base's traced loop."""

  Options = SyncOptions
  takes_reducer = True
  precisions = precision_lib.PRECISIONS
  grad_accumulation = True
  skips_nonfinite = True
  checks_max_loss = True

  @classmethod
  def validate(cls, config, cluster):
    super().validate(config, cluster)
    straggler_lib.check(config.mode_options.straggler,
                        cls.num_replicas(config, cluster), "replicas")
    REDUCERS.get(config.reducer).check(config)

  @classmethod
  def async_checkpoint_refusal(cls, config):
    return REDUCERS.get(config.reducer).async_checkpoint_refusal(
        config.reducer, config.reducer_options)

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    self.is_chief = cluster.is_chief
    self.strategy = self.build_strategy()
    # Every micro-batch of every replica is one share of the step.
    self.contributors = (self.strategy.num_replicas_in_sync
                         * config.grad_accum_steps)
    kind = REDUCERS.get(config.reducer)
    host_model = kind.host_model(config.reducer_options)
    if host_model:
      with tf.device("CPU:0"):
        self.model = models.build_for(config, dataset)
    with self.strategy.scope():
      if not host_model:
        self.model = models.build_for(config, dataset)
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
      self.step = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="step",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    self.reduction = kind(config.reducer_options, config, self.strategy,
                          self.model, self.loss_scale, self.recipe)
    for method in ("weights", "apply"):  # A user's reducer: AutoGraph.
      user_code.convert_method(self.reduction, method)
    self.optimizer = self.reduction.optimizer
    self.float32_bytes = compression.wire.float32_bytes_per_step(
        self.model.trainable_variables)
    self.straggler = straggler_lib.parse(self.options.straggler)

  def checkpoint_items(self):
    return {**super().checkpoint_items(), **self.reduction.checkpoint_items()}

  def on_restore(self):
    super().on_restore()
    self.reduction.on_restore()

  # -- the step: a function of (batch) on the replica's variables --

  def loop_begin(self, start, num_steps):
    """Per-replica state back into the replicas (after a restore), then
    the compressor's warm-up steps in their own (exact) loop."""
    self.reduction.loop_begin()
    exact = min(max(self.reduction.compressor.exact_steps - start, 0),
                num_steps)
    return [(n, v) for n, v in ((exact, _EXACT),
                                (num_steps - exact, _COMPRESSED)) if n]

  def replica_step(self, batch, variant):
    x, y = batch
    scale = self.loss_scale.scale if self.loss_scale is not None else None
    shares, grads = step_core.accumulated_gradients(
        self.task, self.model, x, y, chunks=self.config.grad_accum_steps,
        examples_per_update=self.examples_per_step,
        contributors=self.contributors, scale=scale,
        weights=self.reduction.weights(),
        jit_compile=self.config.jit_compile)
    grads = [tf.convert_to_tensor(g) for g in grads]  # Embeddings: dense.
    ok, means = self.reduction.apply(grads, scale, self.step,
                                     exact=variant == _EXACT)
    return StepResult(shares, ok, means)

  def loop_end(self, end):
    self.reduction.loop_end()
    if self.straggler is not None and not end.traced:
      # A sync step waits for its slowest replica, so one straggler slows
      # every step; tracing time is not compute, so a traced call is skipped.
      straggler_lib.sleep(self.straggler.delay(self.straggler.worker,
                                               end.seconds))

  # -- Reporting: bytes on the wire, memory held --

  def report(self) -> Report:
    wire = self.reduction.wire(int(self.step.numpy()))
    scalars = compression.wire.scalars(wire.handed, self.float32_bytes)
    scalars["comm/ring_bytes_per_step"] = wire.ring
    scalars.update(self.memory())
    return Report(scalars=scalars)

  def summary(self) -> Dict[str, object]:
    step = int(self.step.numpy())
    wire = self.reduction.wire(step)
    total = self.reduction.bytes_total(step)
    per_step = total / step if step else wire.handed
    out = compression.wire.summary(per_step, total, self.float32_bytes)
    out["allreduce_ring_bytes_per_step"] = wire.ring
    out["reducer"] = self.config.reducer
    out["shard"] = self.reduction.stage
    out.update({k.replace("/", "_"): v for k, v in self.memory().items()})
    return out

  def memory(self) -> Dict[str, float]:
    """`memory/...`: what one replica holds (`sharding/accounting.py`)."""
    return self.reduction.memory()
