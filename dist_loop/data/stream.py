"""The sharded, resumable input pipeline.

One global stream of example indices is defined by (seed, position): epoch e is
a permutation drawn from the stateless seed (seed, e), and epochs follow each
other without a gap. Global batch t is stream positions [t*B, (t+1)*B). It is
cut into per-replica batches of B/R examples; replica r of step t gets the
r-th one. So:

* the shards are disjoint and together cover each global batch exactly once;
* the global batch of step t is the same set of examples for any replica
  count, which is what makes 1-device and N-device training equal;
* resuming at step s is a jump to position s*B, not a replay.

Each training process reads one input pipeline: pipeline w yields the
batches of its L local replicas one after the other, replicas [w*L, (w+1)*L)
of every step. `replica_input` stacks them per step on the host, and
`replica_batches` gives each replica its own inside the traced step, which
is what `tf.distribute`'s distributed datasets do, minus their per-device
iterators: those do not inherit a dataset's options, so tf.data autotunes
them, and freeing an autotuned iterator can wait up to a minute (see
`without_autotune`). Every iterator here has autotuning off.
"""

import os

import numpy as np
import tensorflow as tf

from dist_loop.data.base import InputColumn

_EPOCHS_FOREVER = np.iinfo(np.int64).max
# tf.data traces its functions with AutoGraph unless told not to; the
# library's traced code is written without it (`modes/loop.py`).
no_autograph = tf.autograph.experimental.do_not_convert


def parallel_calls() -> int:
  """Parallel parses and reads of an input pipeline: the cores this
  process may run on (what AUTOTUNE falls back to without autotuning,
  stated rather than left to it)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # Not on Linux.
    return os.cpu_count() or 1


def index_stream(num_examples: int, seed: int, start: int) -> tf.data.Dataset:
  """Example indices, epoch after epoch, from stream position `start`."""
  first_epoch, offset = divmod(start, num_examples)

  @no_autograph
  def epoch(e):
    keys = tf.random.stateless_uniform(
        [num_examples], seed=tf.stack([tf.constant(seed, tf.int64), e]))
    return tf.data.Dataset.from_tensor_slices(tf.argsort(keys))

  return (tf.data.Dataset.range(first_epoch, _EPOCHS_FOREVER)
          .flat_map(epoch).skip(offset))


def without_autotune(ds: tf.data.Dataset) -> tf.data.Dataset:
  """`ds` without tf.data's autotuning model.

  Its optimisation thread sleeps up to 60 s between rounds, and freeing an
  iterator cancels it and waits for it. The cancellation's wake-up can be
  missed: TensorFlow marks the iterator cancelled only after running the
  callback that wakes the thread, which may look first, find it not yet
  cancelled and sleep out its round; so closing a run's input could take a
  minute per iterator. The AUTOTUNE values then fall back to TensorFlow's
  defaults, which follow the cores: parallel calls up to the schedulable
  cores, a prefetch buffer that grows when it runs dry. The examples and
  their order are the same.
  """
  options = tf.data.Options()
  options.autotune.enabled = False
  return ds.with_options(options)


def cut(indices: tf.data.Dataset, ctx: tf.distribute.InputContext,
        per_replica: int) -> tf.data.Dataset:
  """The global stream of example indices cut into per-replica batches,
  keeping this input pipeline's local replicas' batches of every step."""
  replicas = ctx.num_replicas_in_sync
  local = replicas // ctx.num_input_pipelines
  ds = indices.batch(per_replica, drop_remainder=True)
  if ctx.num_input_pipelines > 1:
    first = ctx.input_pipeline_id * local
    ds = (ds.batch(replicas, drop_remainder=True)
          .map(no_autograph(lambda group: group[first:first + local]))
          .unbatch())
  return ds


def train_dataset_fn(x, y, global_batch_size: int, seed: int,
                     start_step: int = 0):
  """Returns `dataset_fn(input_context)`: the batches of the input pipeline
  the context names (`replica_input`; async and ps build their own context).

  Args:
    x, y: the training arrays, or a dataset's `InputColumn`s (whose
      `x.train_dataset_fn` builds the input: `data/shards.py` reads files).
    global_batch_size: examples per step over all replicas.
    seed: fixes the order of every epoch.
    start_step: the first step to produce (for resuming).
  """
  if isinstance(x, InputColumn):
    return x.train_dataset_fn(global_batch_size, seed, start_step)
  x_t, y_t = tf.constant(x), tf.constant(y)

  def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
    per_replica = ctx.get_per_replica_batch_size(global_batch_size)
    ds = cut(index_stream(len(x), seed, start_step * global_batch_size),
             ctx, per_replica)
    ds = ds.map(no_autograph(lambda idx: (tf.gather(x_t, idx),
                                          tf.gather(y_t, idx))),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return without_autotune(ds.prefetch(tf.data.AUTOTUNE))

  return dataset_fn


def pipeline_id(cluster) -> int:
  """The input pipeline of a training process of `cluster` (a `Cluster`):
  the chief's is 0 and worker i's is i plus the number of chiefs, as
  MultiWorkerMirroredStrategy numbers workers, and so their replicas."""
  if cluster.task_type in (None, "chief"):
    return 0
  return cluster.task_index + len(cluster.spec.get("chief", ()))


def replica_input(strategy: tf.distribute.Strategy, dataset_fn,
                  pipeline: int = 0):
  """The iterator of this process's input under `strategy`: each element
  stacks its local replicas' batches of one step on the host.

  Args:
    strategy: the strategy whose replicas train.
    dataset_fn: `fn(tf.distribute.InputContext) -> Dataset` (as
      `train_dataset_fn` returns).
    pipeline: this process's input pipeline (`pipeline_id`).
  """
  local = len(strategy.extended.worker_devices)
  replicas = strategy.num_replicas_in_sync
  context = tf.distribute.InputContext(
      num_input_pipelines=replicas // local, input_pipeline_id=pipeline,
      num_replicas_in_sync=replicas)
  with tf.device(_host(strategy)):
    return iter(dataset_fn(context).batch(local, drop_remainder=True))


def replica_batches(strategy: tf.distribute.Strategy, stacked):
  """An element of `replica_input`, in a traced step, as `strategy.run`
  takes it: each replica's own batch. Replica ids run on within a process,
  so a replica's row is its id modulo the local replicas. The rows are cut
  on the host, so only a replica's own batch travels to its device."""
  local = len(strategy.extended.worker_devices)

  def row(context):
    with tf.device(_host(strategy)):
      return tf.nest.map_structure(
          lambda t: t[context.replica_id_in_sync_group % local], stacked)

  return strategy.experimental_distribute_values_from_function(row)


def _host(strategy: tf.distribute.Strategy) -> str:
  """The CPU of the process that runs `strategy`'s local replicas."""
  device = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
  return device.replace(device_type="CPU", device_index=0).to_string()


def eval_dataset(x, y, batch_size: int) -> tf.data.Dataset:
  """The held-out split, in order, last partial batch kept (`x` may be an
  `InputColumn`, whose `eval_dataset` builds it)."""
  if isinstance(x, InputColumn):
    return x.eval_dataset(batch_size)
  return without_autotune(tf.data.Dataset.from_tensor_slices((x, y))
                          .batch(batch_size).prefetch(tf.data.AUTOTUNE))
