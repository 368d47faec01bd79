"""Building tf.distribute strategies that can live side by side in a process.

A MirroredStrategy over CPU devices all-reduces with collective ops, and
every new MirroredStrategy starts numbering its collective groups at 1. Two
strategies in one process (tests, benchmarks, hybrid modes) then reuse the
same collective instances with other shapes or dtypes, and the runtime aborts
("Collective instance 100 expected type 0 and data_type 14 ..."), poisoning
the process. TensorFlow's own tests avoid this with the class attribute
`_collective_key_base`; each strategy built here gets a fresh base instead.

Several processes: `multi_worker` joins the cluster, and gives up after
`--join_timeout_s` naming the tasks that did not come up (by default
TensorFlow waits for them forever, silently); `wait_for_servers` bounds
the wait of a process that connects to servers, such as a ps chief.
MultiWorkerMirroredStrategy broadcasts each variable's initial value from
the chief as the variable is made: a collective, and a wait for every
worker, per variable (117 for a 2-block Transformer with Adam).
`initial_values_from_chief` makes a trainer's variables with their local
values and then gives every worker the chief's in one collective.
"""

import concurrent.futures
import contextlib
import itertools
import re
import socket
import time
from typing import List, Optional

import tensorflow as tf
from absl import logging
# MultiWorkerMirroredStrategy's parent, whose variables take their initial
# values as given (`initial_values_from_chief`).
from tensorflow.python.distribute.mirrored_strategy import MirroredExtended as _MirroredExtended  # pylint: disable=line-too-long

from dist_loop.runtime import cluster as cluster_lib
from dist_loop.runtime.cluster import Cluster, ClusterError

# Group keys per strategy are few (one per device set); leave ample room.
_KEY_SPACING = 10_000
_key_bases = itertools.count(1)


class MirroredStrategy(tf.distribute.MirroredStrategy):
  """`tf.distribute.MirroredStrategy`, its collective keys unique in the
  process."""

  def __init__(self, devices=None, cross_device_ops=None):
    # Read by MirroredExtended while the parent __init__ builds it.
    self._collective_key_base = next(_key_bases) * _KEY_SPACING
    super().__init__(devices=devices, cross_device_ops=cross_device_ops)


def mirrored(devices) -> tf.distribute.Strategy:
  """A MirroredStrategy over `devices` that coexists with others."""
  return MirroredStrategy(devices)


def cross_replica_call(fn, *args, **kwargs):
  """`fn(strategy, *args, **kwargs)` in cross-replica context, from either
  context: through `merge_call` from replica context (inside
  `strategy.run`), directly from cross-replica context (the ps mode's
  update lock). Returns what `fn` returns."""
  if tf.distribute.in_cross_replica_context():
    return fn(tf.distribute.get_strategy(), *args, **kwargs)
  return tf.distribute.get_replica_context().merge_call(
      fn, args=args, kwargs=kwargs)


def on_first_replica(strategy, cache, fn, *args):
  """`fn(*args)` run by `strategy.run` (where mirrored variables can be
  differentiated), the first replica's result returned. `cache` maps each
  `fn` to its `tf.function`, so a repeated call does not retrace."""
  if fn not in cache:
    cache[fn] = tf.function(lambda *a: strategy.run(fn, args=a),
                           autograph=False)
  out = cache[fn](*args)
  return tf.nest.map_structure(
      lambda v: strategy.experimental_local_results(v)[0], out)


# What a collective or a remote op raises when another task of the cluster
# (a peer worker, a parameter server) died or stopped answering.
LOST_TASK_ERRORS = (tf.errors.UnavailableError,
                    tf.errors.DeadlineExceededError, tf.errors.AbortedError,
                    tf.errors.CancelledError)


# -- several processes --

_multi_worker = None


def multi_worker(collective_timeout_s: float,
                 cluster: Optional[Cluster] = None,
                 join_timeout_s: float = 300.0) -> tf.distribute.Strategy:
  """This process's MultiWorkerMirroredStrategy over `cluster`.

  TensorFlow allows one per process, built before any op runs ("Collective
  ops must be configured at program startup"), so the first call (the
  mode's `join_cluster`) builds it and later calls return the same one.
  `collective_timeout_s` bounds every collective: a dead peer gives an
  error, not a hang. Building it joins the cluster (`_join`), which gives
  up after `join_timeout_s`.

  Raises:
    ClusterError: a task of the cluster did not join in time, or this task
      could not start its server.
  """
  global _multi_worker
  if _multi_worker is None:
    if cluster is None:
      raise RuntimeError("the first multi_worker() call names the cluster")
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=collective_timeout_s)
    _multi_worker = _join(cluster, join_timeout_s, lambda resolver: (
        tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver, communication_options=options)))
  return _multi_worker


# The dtypes whose values `initial_values_from_chief` sends as int32 words
# (a bitcast: the same bits): every variable a trainer makes. A variable of
# another dtype keeps the strategy's own broadcast.
_WORD_DTYPES = (tf.float32, tf.int32, tf.float64, tf.int64)


@contextlib.contextmanager
def initial_values_from_chief():
  """On every worker, the variables made inside (under this process's
  MultiWorkerMirroredStrategy) take the chief's initial values, as with the
  strategy's own broadcast per variable, but all in one all-gather when the
  block ends (nothing is sent if it raises). Until then each worker holds
  its own values, and at the end every such variable takes the value the
  chief's has then: what the block does with them must give the same on
  every worker from the same values (local SGD's copy of its model does),
  and nothing outside these variables may depend on them. Without a
  strategy of several workers, nothing changes."""
  strategy = _multi_worker
  if (strategy is None or strategy.num_replicas_in_sync
      == len(strategy.extended.worker_devices)):
    yield
    return
  extended = strategy.extended
  broadcast = extended._get_variable_creator_initial_value  # pylint: disable=protected-access
  made: List[tf.Variable] = []  # Device copies with local values, in order.
  local_next = [False]  # Whether the copy being made has a local value.

  def initial_value(replica_id, device, primary_var, **kwargs):
    # Given (Keras gives it), else the value's own (an array's, a tensor's).
    dtype = kwargs.get("dtype") or getattr(kwargs["initial_value"], "dtype",
                                           None)
    if replica_id == 0:
      local_next[0] = dtype is not None and tf.as_dtype(dtype) in _WORD_DTYPES
      if local_next[0]:  # The value as given: the parent strategy's way.
        return _MirroredExtended._get_variable_creator_initial_value(  # pylint: disable=protected-access
            extended, replica_id, device, primary_var, **kwargs)
    else:  # A copy of replica 0's value on another local device.
      local_next[0] = any(primary_var is v for v in made)
    return broadcast(replica_id=replica_id, device=device,
                     primary_var=primary_var, **kwargs)

  def record(next_creator, **kwargs):
    variable = next_creator(**kwargs)
    if local_next[0]:
      made.append(variable)
    local_next[0] = False
    return variable

  extended._get_variable_creator_initial_value = initial_value  # pylint: disable=protected-access
  try:
    with tf.variable_creator_scope(record):
      yield
  finally:
    del extended._get_variable_creator_initial_value  # The class's again.
  if made:
    _take_chiefs(strategy, made)


def _take_chiefs(strategy, variables) -> None:
  """Assigns each of `variables` (device copies) the chief's value of it:
  every worker lists the same variables in the same order, and the chief's
  words come first in the gather (its first replica is replica 0)."""
  words = [tf.reshape(tf.bitcast(v.read_value(), tf.int32), [-1])
           for v in variables]
  flat = tf.concat(words, 0)
  mine = strategy.experimental_distribute_values_from_function(
      lambda _: flat)
  chiefs = strategy.gather(mine, axis=0)[:flat.shape[0]]
  for variable, part in zip(variables, tf.split(
      chiefs, [int(w.shape[0]) for w in words])):
    if variable.dtype.size == 8:
      part = tf.reshape(part, [-1, 2])
    variable.assign(tf.reshape(tf.bitcast(part, variable.dtype),
                               variable.shape))


# -- joining a cluster, with a bound --
#
# Building the strategy starts this task's server and registers it with the
# cluster's coordination service (on the chief, or worker 0), which waits
# for every task; by default it waits forever for one that never starts.
# The service's own registration barrier bounds that wait on every task,
# and names the tasks it waited for. A task that is not the leader first
# waits for the leader to listen (`_wait_for_leader`).

_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def _join(cluster: Cluster, timeout_s: float, build):
  """`build(resolver)` for `cluster`, bounded by `timeout_s`.

  Raises:
    ClusterError: a task did not join in time, or this one could not start.
  """
  _configure_coordination(cluster, timeout_s)
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(cluster.as_dict()), task_type=cluster.task_type,
      task_id=cluster.task_index, rpc_layer="grpc",
      # Every local GPU, as the strategy counts them by default.
      num_accelerators={"GPU": len(tf.config.list_physical_devices("GPU"))})
  # Said before, not during: the build holds the interpreter while it waits.
  _say_waiting(cluster, _not_listening(cluster), timeout_s)
  _wait_for_leader(cluster, timeout_s)
  try:
    return build(resolver)
  except tf.errors.DeadlineExceededError as e:
    raise ClusterError(_not_joined(cluster, timeout_s, e)) from None
  except tf.errors.OpError as e:
    raise ClusterError(
        f"{cluster.task_name} could not join the cluster "
        f"({cluster_lib.describe(e)}); check that its address "
        f"{dict(cluster.tasks())[cluster.task_name]} is free on this host "
        "and that every task was given the same cluster") from None


# How often a task that is not the leader looks whether the leader listens.
_LEADER_POLL_S = 0.01


def _wait_for_leader(cluster: Cluster, timeout_s: float) -> None:
  """Returns once the coordination service's leader accepts connections (at
  once on the leader itself). A task registers with the leader as it builds
  the strategy; one that tries before the leader listens is retried by
  gRPC only after its reconnect backoff, about a second, which every worker
  then waits in the barrier. Looking every `_LEADER_POLL_S` first, the
  registration goes through as soon as the leader is up.

  Raises:
    ClusterError: the leader did not listen within `timeout_s` (the line of
      a join that timed out).
  """
  leader = _leader_name(cluster)
  if leader == cluster.task_name:
    return
  address = dict(cluster.tasks())[leader]
  deadline = time.monotonic() + timeout_s
  while not _listening(address):
    if time.monotonic() > deadline:
      raise ClusterError(_join_line(cluster, timeout_s, [leader]))
    time.sleep(_LEADER_POLL_S)


def _configure_coordination(cluster: Cluster, timeout_s: float) -> None:
  """The coordination service MultiWorkerMirroredStrategy configures for
  itself when none is (same leader, same jobs), plus the registration
  barrier and its timeout, which no public API sets."""
  # pylint: disable=g-import-not-at-top
  from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
  from tensorflow.python.eager import context
  # pylint: enable=g-import-not-at-top
  spec = tf.train.ClusterSpec(cluster.as_dict())
  context.context().configure_coordination_service(
      service_type="standalone", service_leader=_leader(spec),
      cluster_register_timeout_in_ms=max(int(timeout_s * 1000), 1),
      coordinated_jobs=[
          coordination_config_pb2.CoordinatedJob(
              name=job, num_tasks=spec.num_tasks(job))
          for job in (cluster_lib.CHIEF, cluster_lib.WORKER)
          if job in spec.jobs])
  context.context().coordination_service.cluster_register_with_barrier = True


def _leader(spec: tf.train.ClusterSpec) -> str:
  """The task that runs the coordination service, as TensorFlow picks it."""
  from tensorflow.python.distribute import multi_worker_util  # pylint: disable=g-import-not-at-top
  return multi_worker_util.coordination_leader(spec)


def _leader_name(cluster: Cluster) -> str:
  """The leader as `cluster` names its tasks ("worker:0")."""
  return "{}:{}".format(*_TASK.search(
      _leader(tf.train.ClusterSpec(cluster.as_dict()))).groups())


def _say_waiting(cluster: Cluster, down, timeout_s: float) -> None:
  """One line naming the tasks that are not up yet (`down`), if any: what
  this task is about to wait for."""
  if down:
    logging.info("%s: waiting for %s to start; giving up after "
                 "--join_timeout_s=%g", cluster.task_name, _named(down),
                 timeout_s)


def wait_for_servers(cluster: Cluster, timeout_s: float) -> None:
  """Waits until every other task of `cluster` accepts connections, for a
  process that connects to servers which do not wait for it (a ps chief:
  TensorFlow's connection to the cluster has no timeout). Says once what it
  waits for.

  Raises:
    ClusterError: a task did not start within `timeout_s`.
  """
  deadline = time.monotonic() + timeout_s
  down = _not_listening(cluster)
  _say_waiting(cluster, down, timeout_s)
  while down:
    if time.monotonic() > deadline:
      raise ClusterError(
          f"{_named(down)} did not start within --join_timeout_s="
          f"{timeout_s:g}; start every task of the cluster with the same "
          f"command, or check that {cluster.task_name} can reach them")
    time.sleep(0.5)
    down = _not_listening(cluster)


def _not_listening(cluster: Cluster):
  """The other tasks of `cluster` that accept no connection now."""
  others = [(n, a) for n, a in cluster.tasks() if n != cluster.task_name]
  # At once: an unreachable host costs a connect timeout.
  with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
    up = list(pool.map(lambda task: _listening(task[1]), others))
  return [task for task, listening in zip(others, up) if not listening]


def _named(tasks) -> str:
  return ", ".join(f"{name} ({address})" for name, address in tasks)


def _listening(address: str) -> bool:
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=1):
      return True
  except OSError:
    return False


def _not_joined(cluster: Cluster, timeout_s: float, error) -> str:
  """The one line for a join that timed out, naming the missing tasks: the
  ones the leader's barrier names, or else the leader (a task that is not
  the leader waits to register with it)."""
  text = getattr(error, "message", "") or str(error)
  # The names follow this, one per line, up to a blank line.
  waited = text.partition("timed out task names:")[2].partition("\n\n")[0]
  names = list(dict.fromkeys(  # The message repeats them.
      f"{job}:{index}" for job, index in _TASK.findall(waited)))
  return _join_line(cluster, timeout_s, names or [_leader_name(cluster)])


def _join_line(cluster: Cluster, timeout_s: float, names) -> str:
  """The one line for a join that timed out waiting for the tasks `names`."""
  addresses = dict(cluster.tasks())
  missing = _named((n, addresses.get(n, "?")) for n in names)
  return (f"{missing} did not join the cluster within --join_timeout_s="
          f"{timeout_s:g}; start every task of the cluster with the same "
          f"command, or check that {cluster.task_name} can reach them")
