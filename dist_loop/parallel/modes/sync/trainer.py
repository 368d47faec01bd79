"""Synchronous data parallelism: MirroredStrategy and one explicit all-reduce.

Each replica differentiates its share of the step's mean loss (the step
core, `dist_loop/training/step.py`: a replica's `grad_accum_steps` micro-batches
are `replicas x grad_accum_steps` contributors), so that the SUM over replicas
of its gradients is the gradient of the global-batch mean. The gradients are
all-reduced exactly once, in replica context, by the run's compressor
(`--allreduce_compression`, `dist_loop/parallel/compression`), and applied with
`optim.apply_reduced`, which does not reduce again. The loop around the
step, its input and its metrics are the loop base's (`modes/loop.py`).

A compressor with state (error feedback) keeps it per replica and writes it
only when the step is applied; it is the checkpoint's `compression` entry,
so without one the checkpoint holds what it always did. Such a compressor
gets unscaled gradients (a residual outlives the loss scale it was computed
under). A compressor's warm-up (`exact_steps`) is its own traced loop
(`segments`): the steps before it sum the gradients exactly.
"""

import time
from typing import Dict

import tensorflow as tf

from dist_loop import models
from dist_loop.parallel import compression
from dist_loop.parallel import straggler as straggler_lib
from dist_loop.parallel.modes.base import MODES, Report, Reporting
from dist_loop.parallel.modes.loop import LoopTrainer, StepResult
from dist_loop.parallel.modes.mirrored import Mirrored
from dist_loop.parallel.modes.sync.options import SyncOptions
from dist_loop.parallel.sharding import accounting, zero
from dist_loop.runtime import strategy as strategy_lib
from dist_loop.training import optim
from dist_loop.training import precision as precision_lib
from dist_loop.training import step as step_core

_EXACT, _COMPRESSED = "exact", "compressed"  # The loop variants.


@MODES.register("sync")
class SyncTrainer(Mirrored, LoopTrainer, Reporting):
  """`strategy.run(replica_step)` inside the loop base's traced loop."""

  Options = SyncOptions
  precisions = precision_lib.PRECISIONS
  grad_accumulation = True
  skips_nonfinite = True
  checks_max_loss = True

  @classmethod
  def validate(cls, config, cluster):
    super().validate(config, cluster)
    straggler_lib.check(config.mode_options.straggler,
                        cls.num_replicas(config, cluster), "replicas")
    compression.check_options(config.mode_options)
    zero.check(config, config.mode_options)

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    self.is_chief = cluster.is_chief
    self.strategy = self.build_strategy()
    # Every micro-batch of every replica is one share of the step.
    self.contributors = (self.strategy.num_replicas_in_sync
                         * config.grad_accum_steps)
    self.sharding = None
    if self.options.shard == "weights":
      # Stage 3 keeps no full weights on the devices: the model is a host
      # copy for evaluation and checkpoints (`sharding/zero.py`).
      with tf.device("CPU:0"):
        self.model = models.build_for(config, dataset)
    with self.strategy.scope():
      if self.options.shard != "weights":
        self.model = models.build_for(config, dataset)
      if self.options.shard == "none":
        self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                    self.model.trainable_variables)
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
      self.step = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="step",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    if self.options.shard != "none":
      self.sharding = zero.Sharding(
          self.options.shard, self.strategy, self.model, config.optimizer,
          config.learning_rate, self.options.allreduce_bucket_mb)
      self.optimizer = self.sharding.optimizer
    variables = self.model.trainable_variables
    self.compressor = compression.make(self.options, variables, config.seed)
    self.exact = compression.COMPRESSORS.get("none")(self.options, variables)
    self.compression_state = compression.State(
        self.strategy, self.compressor.initial_state())
    self.float32_bytes = compression.wire.float32_bytes_per_step(variables)
    self.straggler = straggler_lib.parse(self.options.straggler)
    self._on_master_fns = {}

  def checkpoint_items(self):
    items = super().checkpoint_items()
    if self.compression_state:
      items["compression"] = self.compression_state.checkpoint
    return items

  def scope(self):
    return self.strategy.scope()

  def on_master(self, fn, *args):
    return strategy_lib.on_first_replica(self.strategy, self._on_master_fns,
                                         fn, *args)

  def before_train(self):
    self.compression_state.apply()  # After a restore: each replica's own.
    if self.sharding is not None:
      self.sharding.before_train()

  def on_restore(self):
    super().on_restore()
    if self.sharding is not None:
      self.sharding.on_restore()

  # -- the step: a function of (batch) on the replica's variables --

  def segments(self, start, num_steps):
    """The compressor's warm-up steps run in their own (exact) loop."""
    exact = min(max(self.compressor.exact_steps - start, 0), num_steps)
    return [(n, v) for n, v in ((exact, _EXACT),
                                (num_steps - exact, _COMPRESSED)) if n]

  def replica_step(self, batch, variant):
    x, y = batch
    compressor = self.exact if variant == _EXACT else self.compressor
    variables = self.model.trainable_variables
    scale = self.loss_scale.scale if self.loss_scale is not None else None
    weights = self.sharding.weights() if self.sharding else None
    shares, grads = step_core.accumulated_gradients(
        self.task, self.model, x, y, chunks=self.config.grad_accum_steps,
        examples_per_update=self.examples_per_step,
        contributors=self.contributors, scale=scale, weights=weights)
    grads = [tf.convert_to_tensor(g) for g in grads]  # Embeddings: dense.
    if self.sharding is not None:
      ok, norm = self.sharding.apply(
          grads, lambda g: compressor.reduce(g, {}, self.step)[0],
          self.loss_scale, scale)
      return StepResult(shares, ok, {"grad_norm": norm})
    # The warm-up's exact sum (`self.exact`) neither reads nor moves it.
    stateful = compressor is self.compressor and bool(self.compression_state)
    state = self.compression_state.read() if stateful else {}
    if stateful and scale is not None:  # Residuals outlive the loss scale.
      grads, scale = [g / scale for g in grads], None
    grads, state = compressor.reduce(grads, state, self.step.read_value())
    grads, ok = precision_lib.unscale_and_apply(
        self.optimizer, grads, variables, self.loss_scale, scale)
    if stateful:
      self.compression_state.write(state, ok)
    # `ok` and the norm follow the all-reduce: the same on every replica.
    return StepResult(shares, ok, {"grad_norm": tf.linalg.global_norm(grads)})

  def train(self, num_steps: int) -> Dict[str, float]:
    t0, traces = time.perf_counter(), self.trace_count
    metrics = super().train(num_steps)
    if self.sharding is not None:  # Evaluation and checkpoints read it.
      self.sharding.refresh()
    if self.straggler is not None and self.trace_count == traces:
      # A sync step waits for its slowest replica, so one straggler slows
      # every step; tracing time is not compute, so a traced call is skipped.
      straggler_lib.sleep(self.straggler.delay(
          self.straggler.worker, time.perf_counter() - t0))
    return metrics

  # -- Reporting: bytes on the wire, memory held --

  def report(self) -> Report:
    wire = accounting.wire(self, int(self.step.numpy()))
    scalars = compression.wire.scalars(wire.handed, self.float32_bytes)
    scalars["comm/ring_bytes_per_step"] = wire.ring
    scalars.update(accounting.memory(self))
    return Report(scalars=scalars)

  def summary(self) -> Dict[str, object]:
    step = int(self.step.numpy())
    wire = accounting.wire(self, step)
    total = (self.compressor.bytes_total(step)
             + wire.gathers_per_step * wire.shard_bytes * step)
    per_step = total / step if step else wire.handed
    out = compression.wire.summary(per_step, total, self.float32_bytes)
    out["allreduce_ring_bytes_per_step"] = wire.ring
    out["shard"] = self.options.shard
    out.update({k.replace("/", "_"): v
                for k, v in accounting.memory(self).items()})
    return out
