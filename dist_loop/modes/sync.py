"""Synchronous data parallelism: MirroredStrategy and one explicit all-reduce.

Each replica computes its loss scaled to the global batch (sum over its
examples / global batch), so that the SUM over replicas of its gradients is
the gradient of the global-batch mean. The gradients are all-reduced exactly
once, in replica context (`allreduce.all_reduce_sum`), and applied with
`optim.apply_reduced`, which does not reduce again. `steps_per_loop` steps run
inside one `tf.function` call, so the host is visited once per loop.
"""

from typing import Dict

import keras
import tensorflow as tf

from dist_loop import allreduce, models, optim
from dist_loop.data import train_dataset_fn
from dist_loop.errors import NonFiniteError
from dist_loop.modes.base import MODES, Trainer


def make_strategy(devices) -> tf.distribute.Strategy:
  """MirroredStrategy over `devices`; one device still goes through it, so
  the 1-device run exercises the very same code path as the N-device one."""
  return tf.distribute.MirroredStrategy(devices)


@MODES.register("sync")
class SyncTrainer(Trainer):
  """`strategy.run(replica_step)` inside a `tf.function` loop."""

  def __init__(self, config, devices, split):
    super().__init__(config, devices, split)
    self.strategy = make_strategy(devices)
    with self.strategy.scope():
      self.model = models.build(config.model, split.input_shape,
                                split.num_classes)
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables)
      self.step = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="step",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    self.trace_count = 0
    self._iterator = None
    self._on_master_fns = {}
    self._loop = tf.function(self._loop_fn)

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
    with tf.GradientTape() as tape:
      logits = self.model(x, training=True)
      per_example = keras.losses.sparse_categorical_crossentropy(
          y, logits, from_logits=True)
      loss = tf.reduce_sum(per_example) / cfg.global_batch_size
      if self.model.losses:  # Regularisers: once per step, split over replicas.
        loss += tf.add_n(self.model.losses) / self.strategy.num_replicas_in_sync
    grads = tape.gradient(loss, variables)
    grads = allreduce.all_reduce_sum(grads, cfg.allreduce_compression,
                                     cfg.allreduce_bytes_per_pack)
    ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
    optim.apply_reduced(self.optimizer, grads, variables, ok)
    correct = tf.reduce_sum(tf.cast(
        tf.equal(tf.argmax(logits, -1, output_type=tf.int32),
                 tf.cast(y, tf.int32)), tf.float32))
    return {"loss": loss, "accuracy": correct / cfg.global_batch_size,
            "grad_norm": tf.linalg.global_norm(grads), "ok": ok}

  # -- the inner loop: num_steps steps in one tf.function call --

  def _loop_fn(self, iterator, num_steps):
    self.trace_count += 1  # Python side effect: runs once per trace.
    s = self.strategy
    total = {"loss": 0.0, "accuracy": 0.0, "grad_norm": 0.0}
    done = tf.constant(0, tf.int64)
    bad_step = tf.constant(-1, tf.int64)
    for _ in tf.range(num_steps):
      out = s.run(self._replica_step, args=next(iterator))
      self.step.assign_add(1)
      ok = s.experimental_local_results(out["ok"])[0]
      loss = s.reduce(tf.distribute.ReduceOp.SUM, out["loss"], axis=None)
      if not (ok and tf.math.is_finite(loss)):
        bad_step = self.step.read_value()
        break
      done += 1
      total = {
          "loss": total["loss"] + loss,
          "accuracy": total["accuracy"] + s.reduce(
              tf.distribute.ReduceOp.SUM, out["accuracy"], axis=None),
          "grad_norm": total["grad_norm"] + s.reduce(
              tf.distribute.ReduceOp.MEAN, out["grad_norm"], axis=None),
      }
    n = tf.maximum(tf.cast(done, tf.float32), 1.0)
    means = {k: v / n for k, v in total.items()}
    return means, bad_step

  def train(self, num_steps: int) -> Dict[str, float]:
    if self._iterator is None:  # Built lazily: resumes at the restored step.
      fn = train_dataset_fn(self.split.train_x, self.split.train_y,
                            self.config.global_batch_size, self.config.seed,
                            start_step=int(self.step.numpy()))
      self._iterator = iter(self.strategy.distribute_datasets_from_function(fn))
    means, bad_step = self._loop(self._iterator,
                                 tf.constant(num_steps, tf.int64))
    if int(bad_step) >= 0:
      raise NonFiniteError(int(bad_step))
    metrics = {f"train/{k}": float(v) for k, v in means.items()}
    metrics["train/learning_rate"] = float(tf.convert_to_tensor(self.optimizer.learning_rate))
    return metrics
