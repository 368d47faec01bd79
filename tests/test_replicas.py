"""Per-replica variables on 2 logical devices: `write` gives each replica's
component its own value, and `ReplicaState` carries every component through
a checkpoint, read directly or gathered (and refuses one of another replica
count or model)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dist_loop.core.errors import UserError
from dist_loop.runtime import devices
from dist_loop.runtime import strategy as strategy_lib
from dist_loop.training import replicas

SHAPES = ((2, 3), (4,))


def _setup(num_replicas=2):
  """A strategy and two zero variables under it: a Keras one and a bare
  tf.Variable (`replicas` takes both)."""
  strategy = strategy_lib.mirrored(devices.configure(num_replicas, "cpu"))
  with strategy.scope():
    variables = [keras.Variable(np.zeros(SHAPES[0], np.float32)),
                 tf.Variable(np.zeros(SHAPES[1], np.float32))]
  return strategy, variables


def _components(strategy, variables):
  """[variable][replica] -> numpy, read from each component."""
  return [[t.numpy() for t in strategy.experimental_local_results(
      replicas.backing(v))] for v in variables]


def _write_replica_ids(strategy, variables, base=1.0):
  """Writes base + replica id into every element of each replica's
  component, from replica context."""

  @tf.function(autograph=False)
  def run():
    def fn():
      rid = tf.distribute.get_replica_context().replica_id_in_sync_group
      value = base + tf.cast(rid, tf.float32)
      replicas.write(variables, [tf.fill(s, value) for s in SHAPES])
      # Read back in the same replica step: its own component.
      return replicas.backing(variables[1]).read_value()
    return strategy.experimental_local_results(strategy.run(fn))

  return [t.numpy() for t in run()]


def test_write_gives_each_replica_its_own_value():
  strategy, variables = _setup()
  read_back = _write_replica_ids(strategy, variables)
  np.testing.assert_array_equal(read_back, [np.full(4, 1.0), np.full(4, 2.0)])
  for shape, components in zip(SHAPES, _components(strategy, variables)):
    np.testing.assert_array_equal(components[0], np.full(shape, 1.0))
    np.testing.assert_array_equal(components[1], np.full(shape, 2.0))


# Direct reads and writes of the components (one process), and the
# replica steps that MultiWorkerMirroredStrategy needs (forced here).
@pytest.mark.parametrize("collective", [False, True])
def test_replica_state_round_trips_through_a_checkpoint(tmp_path, collective):
  strategy, variables = _setup()
  _write_replica_ids(strategy, variables, base=5.0)
  state = replicas.ReplicaState(strategy, variables, collective=collective)
  values = state.values()
  assert [v.shape for v in values] == [(2, *s) for s in SHAPES]
  for value in values:
    np.testing.assert_array_equal(value[0], np.full(value.shape[1:], 5.0))
    np.testing.assert_array_equal(value[1], np.full(value.shape[1:], 6.0))
  path = tf.train.Checkpoint(replicas=state).save(str(tmp_path / "ckpt"))

  # A new run: the same variables, at zero.
  strategy, restored_vars = _setup()
  restored = replicas.ReplicaState(strategy, restored_vars,
                                   collective=collective)
  tf.train.Checkpoint(replicas=restored).restore(path).assert_consumed()
  # Restored, but not written until `apply`.
  assert restored.pending
  for got, want in zip(restored.values(), values):
    np.testing.assert_array_equal(got, want)
  assert not any(np.any(c) for components in _components(
      strategy, restored_vars) for c in components)
  restored.apply()
  assert not restored.pending
  for var_components, value in zip(_components(strategy, restored_vars),
                                    values):
    for replica, component in enumerate(var_components):
      np.testing.assert_array_equal(component, value[replica])
  # A second apply writes nothing: training since is kept.
  _write_replica_ids(strategy, restored_vars, base=0.0)
  restored.apply()
  assert _components(strategy, restored_vars)[1][1][0] == 1.0


def test_a_state_of_another_replica_count_or_model_is_refused():
  strategy, variables = _setup(2)
  _write_replica_ids(strategy, variables)
  saved = replicas.ReplicaState(strategy, variables).serialize()

  strategy4, variables4 = _setup(4)
  with pytest.raises(UserError, match="2 replicas, this run has 4; resume "
                     "with 2 replicas, or use a new --workdir"):
    replicas.ReplicaState(strategy4, variables4).deserialize(saved)

  with strategy.scope():
    fewer = [tf.Variable(np.zeros(SHAPES[0], np.float32))]
    other_shape = [tf.Variable(np.zeros(SHAPES[0], np.float32)),
                   tf.Variable(np.zeros((5,), np.float32))]
  for other in (fewer, other_shape):
    state = replicas.ReplicaState(strategy, other)
    with pytest.raises(ValueError):
      state.deserialize(saved)
    assert not state.pending
