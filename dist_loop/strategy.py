"""Building tf.distribute strategies that can live side by side in a process.

A MirroredStrategy over CPU devices all-reduces with collective ops, and
every new MirroredStrategy starts numbering its collective groups at 1. Two
strategies in one process (tests, benchmarks, hybrid modes) then reuse the
same collective instances with other shapes or dtypes, and the runtime aborts
("Collective instance 100 expected type 0 and data_type 14 ..."), poisoning
the process. TensorFlow's own tests avoid this with the class attribute
`_collective_key_base`; each strategy built here gets a fresh base instead.
"""

import itertools

import tensorflow as tf

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
    cache[fn] = tf.function(lambda *a: strategy.run(fn, args=a))
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


def multi_worker(collective_timeout_s: float) -> tf.distribute.Strategy:
  """This process's MultiWorkerMirroredStrategy over the TF_CONFIG cluster.

  TensorFlow allows one per process, built before any op runs ("Collective
  ops must be configured at program startup"), so the first call builds it
  and later calls return the same one. `collective_timeout_s` bounds every
  collective: a dead peer gives an error, not a hang.
  """
  global _multi_worker
  if _multi_worker is None:
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=collective_timeout_s)
    _multi_worker = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=options)
  return _multi_worker
