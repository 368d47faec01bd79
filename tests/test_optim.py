"""Optimizers: applying gradients that were already all-reduced."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dist_loop.core.errors import UserError
from dist_loop.runtime import devices
from dist_loop.runtime import strategy as strategy_lib
from dist_loop.training import optim

GRAD = np.array([1.0, 2.0, 3.0], np.float32)


def _build(name, strategy):
  with strategy.scope():
    var = keras.Variable(np.ones(3, np.float32), name="w")
    return var, optim.make(name, 0.1, [var])


def _apply(strategy, optimizer, var, ok, lr_scale=None):
  """Every replica calls apply_reduced with the same (reduced) gradient."""

  @tf.function(autograph=False)
  def step():
    strategy.run(lambda: optim.apply_reduced(
        optimizer, [tf.constant(GRAD)], [var], tf.constant(ok), lr_scale))

  step()


def _copies(strategy, variable):
  value = getattr(variable, "value", variable)
  return [t.numpy() for t in strategy.experimental_local_results(value)]


@pytest.fixture(name="mirrored", scope="module")
def _mirrored():
  return strategy_lib.mirrored(devices.configure(2, "cpu"))


def test_apply_reduced_applies_once_on_every_replica(mirrored):
  var, sgd = _build("sgd", mirrored)
  _apply(mirrored, sgd, var, ok=True)
  # Not reduced again (that would double the step), and one update per copy.
  for copy in _copies(mirrored, var):
    np.testing.assert_allclose(copy, 1.0 - 0.1 * GRAD, rtol=1e-6)
  assert _copies(mirrored, sgd.iterations) == [1, 1]
  _apply(mirrored, sgd, var, ok=True, lr_scale=tf.constant(0.5))
  np.testing.assert_allclose(var.numpy(), 1.0 - 0.15 * GRAD, rtol=1e-6)
  assert int(sgd.iterations.numpy()) == 2


def test_not_ok_skips_variables_slots_and_iterations(mirrored):
  var, adam = _build("adam", mirrored)
  _apply(mirrored, adam, var, ok=False)
  for copy in _copies(mirrored, var):
    np.testing.assert_array_equal(copy, np.ones(3))
  for slot in adam.variables:
    for copy in _copies(mirrored, slot):
      assert not np.any(copy) or slot.path.endswith("learning_rate"), slot.path
  _apply(mirrored, adam, var, ok=True)  # The same call, ok: it moves.
  assert int(adam.iterations.numpy()) == 1
  assert np.all(var.numpy() < 1.0)


def test_with_per_replica_ok_each_replica_decides_for_itself(mirrored):
  """Local SGD's replicas apply their own updates, or not: replica 0's
  goes through, replica 1's is skipped, counter included."""
  var, sgd = _build("sgd", mirrored)

  @tf.function(autograph=False)
  def step():
    def replica():
      first = tf.equal(
          tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
      optim.apply_reduced(sgd, [tf.constant(GRAD)], [var], first,
                          per_replica_ok=True)
    mirrored.run(replica)

  step()
  applied, skipped = _copies(mirrored, var)
  np.testing.assert_allclose(applied, 1.0 - 0.1 * GRAD, rtol=1e-6)
  np.testing.assert_array_equal(skipped, np.ones(3))
  assert _copies(mirrored, sgd.iterations) == [1, 0]


def test_apply_reduced_outside_any_strategy():
  var, sgd = _build("momentum", tf.distribute.get_strategy())
  ok = optim.apply_reduced(sgd, [tf.constant(GRAD)], [var], tf.constant(True))
  assert bool(ok)
  np.testing.assert_allclose(var.numpy(), 1.0 - 0.1 * GRAD, rtol=1e-6)


def test_all_finite_and_unknown_names():
  assert bool(optim.all_finite([tf.ones(2), tf.zeros((2, 2))]))
  assert not bool(optim.all_finite([tf.ones(2), tf.constant([np.inf])]))
  assert not bool(optim.all_finite([tf.constant([np.nan])]))
  with pytest.raises(UserError, match="unknown --optimizer='lamb'.*adam"):
    optim.make("lamb", 0.1, [])


def _train_adam(strategy, name, shared, per_replica_ok, lr_scale, monkeypatch):
  """Three updates of two variables (one decayed by AdamW), with Adam's
  values shared across variables or computed per variable by Keras's own
  `update_step`; returns every variable's copies and the traced graph."""
  monkeypatch.setattr(optim, "_plain_adam",
                      lambda o: shared and isinstance(o, keras.optimizers.Adam))
  rng = np.random.default_rng(0)
  with strategy.scope():
    variables = [keras.Variable(rng.normal(size=s).astype(np.float32))
                 for s in ((3, 4), (4,))]
    optimizer = optim.make(name, 0.1, variables, weight_decay=0.01)
  grads = [tf.constant(rng.normal(size=(3,) + tuple(v.shape)), tf.float32)
           for v in variables]

  @tf.function(autograph=False)
  def step(i):
    def replica():
      ok = tf.constant(True)
      if per_replica_ok:  # Replica 1 skips the second update.
        index = tf.distribute.get_replica_context().replica_id_in_sync_group
        ok = tf.logical_not(tf.logical_and(tf.equal(index, 1),
                                           tf.equal(i, 1)))
      optim.apply_reduced(optimizer, [g[i] for g in grads], variables, ok,
                          lr_scale, per_replica_ok=per_replica_ok,
                          learning_rate=tf.constant(0.05) * tf.cast(
                              i + 1, tf.float32))
    strategy.run(replica)

  for i in range(3):
    step(tf.constant(i))
  values = [copy for v in variables + optimizer.variables
            for copy in _copies(strategy, v)]
  graph = step.get_concrete_function(tf.constant(0)).graph.as_graph_def()
  return values, graph


@pytest.mark.parametrize("name,per_replica_ok,lr_scale", [
    ("adam", False, None), ("adamw", True, 0.5)])
def test_adam_shares_its_step_size_with_the_same_updates(
    mirrored, monkeypatch, name, per_replica_ok, lr_scale):
  """Adam's step size, computed once per device copy instead of per
  variable: the same bits as Keras's `update_step`, with fewer ops."""
  runs = {shared: _train_adam(mirrored, name, shared, per_replica_ok,
                              None if lr_scale is None else
                              tf.constant(lr_scale), monkeypatch)
          for shared in (False, True)}
  (keras_values, keras_graph), (values, graph) = runs[False], runs[True]
  for ours, theirs in zip(values, keras_values):
    np.testing.assert_array_equal(ours, theirs)
  assert not np.array_equal(values[0], _copies(mirrored, keras.Variable(
      np.zeros((3, 4), np.float32)))[0])  # Trained.

  def pows(graph_def):
    nodes = [*graph_def.node, *(node for f in graph_def.library.function
                                for node in f.node_def)]
    return sum(node.op == "Pow" for node in nodes)
  # Two powers of the betas per step size: per device copy, not per
  # variable and copy.
  assert pows(keras_graph) == 2 * 2 * 2
  assert pows(graph) == 2 * 2
