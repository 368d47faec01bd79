"""Local SGD and DiLoCo (--mode=local_sgd), equivalences first.

* H=1, `average`, outer learning rate 1 is synchronous SGD (with gradient
  accumulation too: 2 micro-batches of 16 are the whole batch of 32): in
  test_sync_equivalence.py, against its one-device reference.
* Between synchronisations a replica trains exactly as it would alone on its
  shard, with its own optimizer state; a synchronisation is the outer
  optimizer's step on the mean pseudo-gradient, and every replica restarts
  from its result.
* A resume mid-period equals the uninterrupted run (in the same test as
  the one above: one uninterrupted trainer answers both).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import max_diff
from helpers import NAN_DATASET, load_data
import dist_loop.parallel.modes.local_sgd  # noqa: F401  (registers the mode)
from dist_loop import configure, train
from dist_loop.core.errors import NonFiniteError, UserError
from dist_loop.data.stream import train_dataset_fn
from dist_loop.parallel.modes import build_trainer
from dist_loop.parallel.modes.local_sgd import outer
from dist_loop.parallel.modes.local_sgd.options import LocalSGDOptions
from dist_loop.runtime import checkpoints, devices, resume
from dist_loop.runtime import strategy as strategy_lib
from dist_loop.runtime.cluster import Cluster
from dist_loop.training import optim
from dist_loop.training import replicas
from dist_loop.training import step as step_lib

LOCAL = dict(mode="local_sgd", num_devices=2)


def _trainer(config):
  """The mode's trainer alone (no controller), initialised as `train.run`."""
  config = configure.validate(config, Cluster())
  names = devices.configure(config.num_devices, "cpu")
  keras.utils.set_random_seed(config.seed)
  return build_trainer(config, names, load_data(config), Cluster())


def _components(trainer, variables):
  """[replica][variable] numpy values of per-replica variables."""
  per_var = [[np.asarray(c) for c in trainer.strategy
              .experimental_local_results(replicas.backing(v))]
             for v in variables]
  return [list(r) for r in zip(*per_var)]


def _synced(trainer):
  return [np.asarray(v) for v in trainer.model.trainable_variables]


class _Alone:
  """One replica training by itself on its shard of every global batch."""

  def __init__(self, trainer, replica, weights):
    cfg = trainer.config
    self.task, self.replica = trainer.task, replica
    self.batch = trainer.examples_per_replica
    self.model = trainer.model.__class__.from_config(
        trainer.model.get_config())
    self.set_weights(weights)
    self.optimizer = optim.make(cfg.optimizer, cfg.learning_rate,
                                self.model.trainable_variables)
    stream = train_dataset_fn(trainer.dataset.train_x,
                              trainer.dataset.train_y,
                              trainer.examples_per_step, cfg.seed)
    shards = stream(tf.distribute.InputContext(num_replicas_in_sync=2))
    # The stream yields replica 0's then replica 1's batch of each step.
    self.batches = iter(shards.skip(replica).shard(2, 0))

  def set_weights(self, weights):
    for v, w in zip(self.model.trainable_variables, weights):
      v.assign(w)

  def weights(self):
    return [np.asarray(v) for v in self.model.trainable_variables]

  def train(self, steps):
    for _ in range(steps):
      x, y = next(self.batches)
      _, grads = step_lib.gradients(self.task, self.model, x, y,
                                    examples_per_update=self.batch)
      self.optimizer.apply(grads, self.model.trainable_variables)


def _state(trainer):
  """Everything a resume must restore: the synchronised variables, every
  replica's variables and optimizer slots, and the outer optimizer's."""
  return (_synced(trainer)
          + sum(_components(trainer, trainer.replica_model.variables), [])
          + sum(_components(trainer, trainer.optimizer.variables), [])
          + [np.asarray(v) for v in trainer.outer_optimizer.variables])


def test_replicas_train_alone_between_syncs_and_a_resume_mid_period(
    small_config, monkeypatch, tmp_path):
  # One trainer answers both: between synchronisations each replica trains
  # as it would alone and DiLoCo's outer step is Nesterov's on the mean
  # pseudo-gradient; and a checkpoint saved mid-period (step 7, the
  # replicas diverged) resumes to the same state at step 12 as it reaches
  # uninterrupted, across the synchronisations at 8 and 12.
  reduced = []  # The elements of each all-reduce, as each replica traces it.
  gathered = []  # The same for each all-gather.
  original = tf.distribute.ReplicaContext.all_reduce
  original_gather = tf.distribute.ReplicaContext.all_gather

  def spy(self, reduce_op, value, options=None):
    if self.num_replicas_in_sync > 1:  # Not the lone references' Keras.
      reduced.append(sum(int(np.prod(t.shape))
                         for t in tf.nest.flatten(value)))
    return original(self, reduce_op, value, options=options)

  def spy_gather(self, value, axis, options=None):
    if self.num_replicas_in_sync > 1:
      gathered.append(int(np.prod(value.shape)))
    return original_gather(self, value, axis, options=options)

  monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", spy)
  monkeypatch.setattr(tf.distribute.ReplicaContext, "all_gather", spy_gather)
  lr, mu = 0.7, 0.9

  def make(name):
    return _trainer(small_config(
        **LOCAL, workdir=str(tmp_path / name), sync_every=4, train_steps=12,
        optimizer="adam", learning_rate=0.01, outer_optimizer="nesterov",
        outer_learning_rate=lr, outer_momentum=mu))

  trainer = make("whole")
  start = _synced(trainer)
  alone = [_Alone(trainer, r, start) for r in range(2)]
  sync, momentum = [w.copy() for w in start], [0 * w for w in start]
  for period in range(2):
    trainer.train(3)
    for a in alone:
      a.train(3)
    mine = _components(trainer, trainer.replica_model.trainable_variables)
    for r in range(2):
      assert max_diff(mine[r], alone[r].weights()) <= 1e-5
    assert max_diff(mine[0], mine[1]) > 1e-3  # They did diverge.
    if period == 1:  # Step 7: mid-period. Every step has been traced.
      monkeypatch.undo()  # A save gathers the replicas' variables.
      checkpoints.manager(trainer.checkpoint_items(), str(tmp_path),
                          3).save(checkpoint_number=7)
    trainer.train(1)  # Step 4 (8): a synchronisation.
    for a in alone:
      a.train(1)
    # Keras SGD with Nesterov momentum on g = mean(sync - replica).
    for i, w in enumerate(sync):
      g = w - (alone[0].weights()[i] + alone[1].weights()[i]) / 2
      momentum[i] = mu * momentum[i] - lr * g
      sync[i] = w + mu * momentum[i] - lr * g
    assert max_diff(_synced(trainer), sync) <= 1e-5, period
    sync = _synced(trainer)
    for r, weights in enumerate(_components(
        trainer, trainer.replica_model.trainable_variables)):
      assert max_diff(weights, sync) == 0  # Every replica restarts from it.
      alone[r].set_weights(sync)  # Its own optimizer state carries on.
  report = trainer.report().scalars
  # Nothing but the pseudo-gradient and, once per loop, one row of sums
  # (loss, accuracy, replica grad norm and 4 counts), traced once.
  params = sum(w.size for w in sync)
  assert sorted(reduced) == [params, params]
  assert gathered == [7, 7]
  assert report["comm/ratio_to_float32"] == 1 / 4
  assert report["local_sgd/pseudo_gradient_norm"] > 0

  trainer.train(4)  # Uninterrupted to 12.
  resumed = make("resumed")  # Its own initial state: all must be restored.
  assert resume.restore_latest(
      checkpoints.manager(resumed.checkpoint_items(), str(tmp_path), 3),
      resumed.scope())
  assert int(resumed.step.numpy()) == 7
  resumed.train(5)
  assert int(resumed.step.numpy()) == int(trainer.step.numpy()) == 12
  assert max_diff(_state(trainer), _state(resumed)) <= 1e-6
  trainer.close()
  resumed.close()


def test_non_finite_step_is_not_applied_and_named(small_config):
  trainer = _trainer(small_config(**LOCAL, dataset=NAN_DATASET,
                                  sync_every=2, train_steps=4))
  before = _components(trainer, trainer.replica_model.trainable_variables)
  synced = _synced(trainer)
  with pytest.raises(NonFiniteError, match="at step 1"):
    trainer.train(2)  # Step 2 synchronises what the replicas applied.
  assert int(trainer.step.numpy()) == 2  # Its replicas could not stop.
  after = _components(trainer, trainer.replica_model.trainable_variables)
  for r in range(2):  # No replica applied a step; the sync moved nothing.
    assert max_diff(before[r], after[r]) == 0, r
  assert max_diff(_synced(trainer), synced) == 0
  trainer.close()


@pytest.mark.parametrize("flags,message", [
    (dict(mode="sync", sync_every=4), "--sync_every is an option of "
     "--mode=local_sgd"),
    (dict(sync_every=0), "--sync_every must be >= 1"),
    (dict(outer_learning_rate=0.0), "--outer_learning_rate must be > 0"),
    (dict(outer_momentum=0.9), "needs --outer_optimizer=nesterov"),
    (dict(outer_optimizer="nesterov"), "needs 0 < --outer_momentum < 1"),
    (dict(outer_optimizer="adam"), "unknown --outer_optimizer='adam'"),
    (dict(sync_every=3, train_steps=10), "use --train_steps=9 or 12"),
    (dict(nonfinite="skip"), "use --nonfinite=rollback or raise"),
    (dict(precision="mixed_float16"), "use one of float32, mixed_bfloat16"),
    (dict(global_batch_size=33), "use 32 or 34"),
])
def test_bad_combinations_are_one_line_errors(small_config, flags, message):
  with pytest.raises(UserError, match=message) as error:
    configure.validate(small_config(**{**LOCAL, **flags}), Cluster())
  assert "\n" not in str(error.value)


def test_diloco_reaches_a_sane_accuracy_on_digits(small_config):
  summary = train.run(small_config(
      **LOCAL, dataset="digits", model="mlp", optimizer="adam",
      learning_rate=0.003, global_batch_size=64, train_steps=160,
      sync_every=8, outer_optimizer="nesterov", outer_learning_rate=0.7,
      outer_momentum=0.9, steps_per_loop=40, log_every=80, eval_every=160,
      checkpoint_every=160))
  assert summary["eval_accuracy"] > 0.9
  assert summary["allreduce_ratio_to_float32"] == 1 / 8


def test_synchronise_averages_weights_and_batch_norm_statistics():
  strategy = strategy_lib.mirrored(devices.configure(2, "cpu"))
  with strategy.scope():
    synced, mine = [keras.Sequential([
        keras.Input((3,)), keras.layers.BatchNormalization()])
                    for _ in range(2)]
    optimizer = outer.make(LocalSGDOptions(), synced.trainable_variables)

  def diverge():  # Replica r's weights all r + 1: gamma, beta, mean, var.
    r = tf.distribute.get_replica_context().replica_id_in_sync_group
    replicas.write(mine.weights, [tf.fill(v.shape, tf.cast(r + 1, v.dtype))
                                  for v in mine.weights])

  @tf.function(autograph=False)
  def run():
    strategy.run(diverge)
    strategy.run(outer.synchronise, args=(synced, mine, optimizer))

  run()
  for model in (synced, mine):
    for v in model.weights:  # Trainable and statistics: the mean, 1.5.
      for c in strategy.experimental_local_results(replicas.backing(v)):
        np.testing.assert_allclose(np.asarray(c), 1.5)
