"""Synchronous data parallelism: MirroredStrategy and one explicit all-reduce.

Each replica computes its loss scaled to the global batch (sum over its
examples / global batch), so that the SUM over replicas of its gradients is
the gradient of the global-batch mean. The gradients are all-reduced exactly
once, in replica context (`allreduce.all_reduce_sum`), and applied with
`optim.apply_reduced`, which does not reduce again. `steps_per_loop` steps run
inside one `tf.function` call, so the host is visited once per loop.
"""

import time
from typing import Dict

import keras
import tensorflow as tf

from dist_loop import allreduce, models, optim
from dist_loop import precision as precision_lib
from dist_loop import cluster as cluster_lib
from dist_loop import devices as devices_lib
from dist_loop import straggler as straggler_lib
from dist_loop import strategy as strategy_lib
from dist_loop.data import train_dataset_fn
from dist_loop.errors import NonFiniteError, UserError
from dist_loop.modes.base import MODES, Trainer
from dist_loop.modes.sync.options import SyncOptions


def make_strategy(devices, collective_timeout_s: float = 120.0,
                  num_trainers: int = 1) -> tf.distribute.Strategy:
  """The one place sync mode picks its strategy.

  * several training processes (`num_trainers`, from TF_CONFIG): the process's
    MultiWorkerMirroredStrategy (built by `join_cluster` at start-up), whose
    replicas are every worker's devices and whose collectives fail after
    `collective_timeout_s`;
  * otherwise MirroredStrategy over `devices`; one device still goes through
    it, so the 1-device run exercises the very same code path as the
    N-device one.

  Either way the step below is the same: one explicit all-reduce.
  """
  if num_trainers > 1:
    return strategy_lib.multi_worker(collective_timeout_s)
  return strategy_lib.mirrored(devices)


@MODES.register("sync")
class SyncTrainer(Trainer):
  """`strategy.run(replica_step)` inside a `tf.function` loop."""

  Options = SyncOptions
  multi_process = True

  @classmethod
  def num_replicas(cls, config, cluster):
    # Multi-worker: every training process contributes its devices.
    return config.num_devices * max(cluster.num_trainers, 1)

  @classmethod
  def validate(cls, config, cluster):
    if cluster.num_ps:
      raise UserError("TF_CONFIG has parameter servers ('ps' tasks); use "
                      "--mode=ps, or a cluster of workers only for --mode=sync")
    if (cluster.num_trainers > 1 and config.num_devices > 1
        and devices_lib.resolve_device_type(config.device_type) == "cpu"):
      raise UserError(
          f"--num_devices={config.num_devices}: MultiWorkerMirroredStrategy "
          "runs one replica per worker on CPU; use --num_devices=1 and more "
          "workers")
    super().validate(config, cluster)
    straggler_lib.check(config.mode_options.straggler,
                        cls.num_replicas(config, cluster), "replicas")

  @classmethod
  def join_cluster(cls, config, cluster):
    if cluster.num_trainers > 1:
      strategy_lib.multi_worker(config.collective_timeout_s)

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    self.is_chief = cluster.is_chief
    self.strategy = make_strategy(devices, config.collective_timeout_s,
                                  cluster.num_trainers)
    if self.strategy.num_replicas_in_sync != self.num_replicas(config,
                                                               cluster):
      raise UserError(
          f"the strategy has {self.strategy.num_replicas_in_sync} replicas "
          f"but --num_devices={config.num_devices} on each of "
          f"{cluster.num_trainers} workers asks for "
          f"{self.num_replicas(config, cluster)}; make every worker see "
          "--num_devices devices")
    with self.strategy.scope():
      self.model = models.build_for(config, dataset)
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables)
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
      self.step = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="step",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    self.trace_count = 0
    self.straggler = straggler_lib.parse(self.options.straggler)
    self._iterator = None
    self._on_master_fns = {}
    self._loop = tf.function(self._loop_fn)

  # Capabilities that Trainer.validate_config checks.
  precisions = precision_lib.PRECISIONS
  grad_accumulation = True
  skips_nonfinite = True

  def on_restore(self):
    self._iterator = None  # Rebuilt from the restored step.

  def close(self):
    # Free the multi-device input iterator now, while its threads can still
    # finish: destroyed at interpreter exit it can block for minutes.
    self._iterator = None

  def scope(self):
    return self.strategy.scope()

  def on_master(self, fn, *args):
    if fn not in self._on_master_fns:  # One tf.function per fn: no retrace.
      self._on_master_fns[fn] = tf.function(
          lambda *a: self.strategy.run(fn, args=a))
    out = self._on_master_fns[fn](*args)
    return tf.nest.map_structure(
        lambda v: self.strategy.experimental_local_results(v)[0], out)

  # -- the replica step: a function of (batch) on the replica's variables --

  def _replica_step(self, x, y):
    cfg = self.config
    variables = self.model.trainable_variables
    scale = self.loss_scale.scale if self.loss_scale is not None else None
    loss, correct, grads = self._accumulated_gradients(x, y, scale)
    grads = allreduce.all_reduce_sum(grads, self.options.allreduce_compression,
                                     self.options.allreduce_bytes_per_pack)
    grads, ok = precision_lib.unscale_and_apply(
        self.optimizer, grads, variables, self.loss_scale, scale)
    return {"loss": loss, "accuracy": correct / self.examples_per_step,
            "grad_norm": tf.linalg.global_norm(grads), "ok": ok}

  def _gradients(self, x, y, scale):
    """One micro-batch: its share of the step's mean loss, its correct
    predictions, and the (scaled) gradients of that share."""
    with tf.GradientTape() as tape:
      logits = tf.cast(self.model(x, training=True), tf.float32)
      per_example = keras.losses.sparse_categorical_crossentropy(
          y, logits, from_logits=True)
      loss = tf.reduce_sum(per_example) / self.examples_per_step
      if self.model.losses:  # Regularisers: once per step, split up.
        loss += tf.add_n(self.model.losses) / (
            self.strategy.num_replicas_in_sync * self.config.grad_accum_steps)
      scaled = loss if scale is None else loss * scale
    grads = tape.gradient(scaled, self.model.trainable_variables)
    correct = tf.reduce_sum(tf.cast(
        tf.equal(tf.argmax(logits, -1, output_type=tf.int32),
                 tf.cast(y, tf.int32)), tf.float32))
    return loss, correct, grads

  def _accumulated_gradients(self, x, y, scale):
    """Sums the gradients of `grad_accum_steps` micro-batches of the
    replica's batch, one after the other, so that only one micro-batch of
    activations is alive at a time. The all-reduce comes after, once."""
    n = self.config.grad_accum_steps
    if n == 1:
      return self._gradients(x, y, scale)
    xs = tf.reshape(x, tf.concat([[n, -1], tf.shape(x)[1:]], 0))
    ys = tf.reshape(y, [n, -1])
    loss, correct, grads = self._gradients(xs[0], ys[0], scale)
    for i in tf.range(1, n):
      l, c, g = self._gradients(xs[i], ys[i], scale)
      loss, correct = loss + l, correct + c
      grads = [a + b for a, b in zip(grads, g)]
    return loss, correct, grads

  # -- the inner loop: num_steps steps in one tf.function call --

  def _loop_fn(self, iterator, num_steps):
    self.trace_count += 1  # Python side effect: runs once per trace.
    s = self.strategy
    total = {"loss": 0.0, "accuracy": 0.0, "grad_norm": 0.0}
    done = tf.constant(0, tf.int64)
    skipped = tf.constant(0, tf.int64)
    bad_step = tf.constant(-1, tf.int64)
    # With loss scaling, an overflow is expected now and then: that step is
    # skipped on every replica and the scale drops. With --nonfinite=skip,
    # any non-finite step is. Otherwise it stops the loop and is raised.
    skip_all = self.config.nonfinite == "skip"
    may_skip = skip_all or self.loss_scale is not None
    for _ in tf.range(num_steps):
      out = s.run(self._replica_step, args=next(iterator))
      self.step.assign_add(1)
      ok = s.experimental_local_results(out["ok"])[0]
      loss = s.reduce(tf.distribute.ReduceOp.SUM, out["loss"], axis=None)
      loss_ok = tf.math.is_finite(loss)
      if not (loss_ok or skip_all) or not (ok or may_skip):
        bad_step = self.step.read_value()
        break
      done += 1
      if not (ok and loss_ok):
        skipped += 1
        continue
      total = {
          "loss": total["loss"] + loss,
          "accuracy": total["accuracy"] + s.reduce(
              tf.distribute.ReduceOp.SUM, out["accuracy"], axis=None),
          "grad_norm": total["grad_norm"] + s.reduce(
              tf.distribute.ReduceOp.MEAN, out["grad_norm"], axis=None),
      }
    n = tf.maximum(tf.cast(done - skipped, tf.float32), 1.0)
    means = {k: v / n for k, v in total.items()}
    means["skipped_steps"] = tf.cast(skipped, tf.float32)
    if self.loss_scale is not None:
      means["loss_scale"] = self.loss_scale.scale.read_value()
    return means, bad_step

  @classmethod
  def cluster_error(cls, config, cluster, error):
    if (not isinstance(error, strategy_lib.LOST_TASK_ERRORS)
        or cluster.num_trainers <= 1):
      return None
    return cluster_lib.ClusterError(
        f"a peer worker failed or is unreachable "
        f"({cluster_lib.describe(error)}); every collective gives up after "
        f"--collective_timeout_s={config.collective_timeout_s:g}. "
        "Restart every worker with the same command: training resumes from "
        "the last checkpoint")

  def train(self, num_steps: int) -> Dict[str, float]:
    if self._iterator is None:  # Built lazily: resumes at the restored step.
      fn = train_dataset_fn(self.dataset.train_x, self.dataset.train_y,
                            self.examples_per_step, self.config.seed,
                            start_step=int(self.step.numpy()))
      self._iterator = iter(self.strategy.distribute_datasets_from_function(fn))
    t0, traces = time.perf_counter(), self.trace_count
    means, bad_step = self._loop(self._iterator,
                                 tf.constant(num_steps, tf.int64))
    if int(bad_step) >= 0:
      raise NonFiniteError(int(bad_step))
    if self.straggler is not None and self.trace_count == traces:
      # A sync step waits for its slowest replica, so one straggler slows
      # every step; tracing time is not compute, so a traced call is skipped.
      straggler_lib.sleep(self.straggler.delay(
          self.straggler.worker, time.perf_counter() - t0))
    metrics = {f"train/{k}": float(v) for k, v in means.items()}
    metrics["train/learning_rate"] = float(tf.convert_to_tensor(self.optimizer.learning_rate))
    return metrics
