"""Strategies that share a process, and the two calls every mode uses to
step out of replica context: cross_replica_call and on_first_replica."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO
from dist_loop.runtime import devices
from dist_loop.runtime import strategy as strategy_lib
from tools import launch


def _names(n=2):
  return devices.configure(n, "cpu")


def _all_reduce(strategy, value):
  """The sum over replicas of `value + replica id`, traced, as replica 0
  sees it."""

  @tf.function(autograph=False)
  def run():
    def fn():
      ctx = tf.distribute.get_replica_context()
      return ctx.all_reduce(
          tf.distribute.ReduceOp.SUM,
          value + tf.cast(ctx.replica_id_in_sync_group, value.dtype))
    return strategy.experimental_local_results(strategy.run(fn))[0]

  return run().numpy()


def test_strategies_in_one_process_all_reduce_without_colliding():
  """Each strategy's collectives have their own keys: a second strategy's
  all-reduce of another shape and dtype does not take the first one's
  collective instance (which TensorFlow refuses and aborts)."""
  first = strategy_lib.mirrored(_names(2))
  np.testing.assert_array_equal(
      _all_reduce(first, tf.ones([3], tf.float32)), [3.0] * 3)
  second = strategy_lib.mirrored(_names(2))
  np.testing.assert_array_equal(
      _all_reduce(second, tf.ones([5], tf.int32)), [3] * 5)
  third = strategy_lib.mirrored(_names(4))
  np.testing.assert_array_equal(
      _all_reduce(third, tf.ones([2, 2], tf.float64)), np.full((2, 2), 10.0))
  # The first still works after the others.
  np.testing.assert_array_equal(
      _all_reduce(first, tf.zeros([3], tf.float32)), [1.0] * 3)


def test_cross_replica_call_from_replica_and_cross_replica_context():
  strategy = strategy_lib.mirrored(_names(2))
  seen = []

  def fn(got, value, *, offset):
    seen.append((got, tf.distribute.in_cross_replica_context()))
    # From replica context `value` holds every replica's value.
    return tf.add_n(list(got.experimental_local_results(value))) + offset

  # From replica context, inside `strategy.run`: through merge_call, so
  # `fn` runs once for both replicas and sees their values together.
  @tf.function(autograph=False)
  def in_replicas():
    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      replica = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
      return replica + strategy_lib.cross_replica_call(fn, replica + 1.0,
                                                       offset=10.0)
    return strategy.experimental_local_results(strategy.run(replica_fn))

  results = in_replicas()
  assert len(seen) == 1 and seen[0] == (strategy, True)
  # Each replica gets what `fn` returned (1 + 2 + 10), plus its id.
  assert [float(v) for v in results] == [13.0, 14.0]

  # From cross-replica context: called directly, with the scope's strategy.
  seen.clear()
  with strategy.scope():
    out = strategy_lib.cross_replica_call(fn, tf.constant(1.0), offset=2.0)
  assert float(out) == 3.0
  assert seen == [(strategy, True)]


def test_on_first_replica_returns_replica_0s_result_and_traces_once():
  strategy = strategy_lib.mirrored(_names(2))
  with strategy.scope():
    weight = tf.Variable(3.0)
  traces = []

  def fn(x):
    # Python runs at trace time only (once per replica per trace).
    traces.append(x.shape)
    ctx = tf.distribute.get_replica_context()
    with tf.GradientTape() as tape:
      loss = weight * weight * x
    # The mirrored variable is differentiable inside strategy.run.
    return tape.gradient(loss, weight), ctx.replica_id_in_sync_group

  cache = {}
  grad, replica = strategy_lib.on_first_replica(strategy, cache,
                                                fn, tf.constant(2.0))
  assert float(grad) == 12.0 and int(replica) == 0
  assert list(cache) == [fn]
  traced = len(traces)
  assert traced >= 1
  grad, _ = strategy_lib.on_first_replica(strategy, cache, fn,
                                          tf.constant(5.0))
  assert float(grad) == 30.0
  assert len(traces) == traced  # The cached function, not a new trace.
  # Another cache (another trainer) traces its own.
  strategy_lib.on_first_replica(strategy, {}, fn, tf.constant(5.0))
  assert len(traces) > traced


# A worker of a two-worker MultiWorkerMirroredStrategy: variables of its
# own values (the task index in them), made in `initial_values_from_chief`;
# prints their values and how many broadcasts it ran.
_WORKER = """
import json
from experiments import startup
startup.start(0)
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops
from dist_loop.runtime import cluster, strategy
broadcasts = []
for name in ("broadcast_send", "broadcast_recv"):
  def counted(*args, _op=getattr(collective_ops, name), **kwargs):
    broadcasts.append(1)
    return _op(*args, **kwargs)
  setattr(collective_ops, name, counted)
task = cluster.current().task_index
mwms = strategy.multi_worker(60, cluster.current(), join_timeout_s=60)
with strategy.initial_values_from_chief(), mwms.scope():
  made = [tf.Variable(np.full((2, 3), task + 0.5, np.float32)),
          tf.Variable(np.int64(task + 7)),
          tf.Variable(np.array([task, -0.0], np.float64)),
          tf.Variable(np.bool_(task))]
print(json.dumps({"broadcasts": len(broadcasts), "values": [
    v.numpy().tolist() for v in made]}))
"""


@pytest.mark.timeout(180)
def test_two_workers_take_the_chiefs_initial_values_in_one_collective():
  """Each worker makes its variables with values of its own: after the
  block both hold the chief's, bit for bit (-0.0 too), and only the bool,
  a dtype sent otherwise, was broadcast on its own."""
  spec = launch.cluster_spec(num_workers=2, num_ps=0)
  procs = [subprocess.Popen(
      [sys.executable, "-c", _WORKER], cwd=REPO, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": json.dumps(
          {"cluster": spec, "task": {"type": "worker", "index": i}})})
      for i in range(2)]
  try:
    outputs = [p.communicate(timeout=150)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out
  results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
  for result in results:
    assert result["values"] == [[[0.5] * 3] * 2, 7, [0.0, -0.0], False]
    assert np.signbit(result["values"][2][1])
    assert result["broadcasts"] == 1
