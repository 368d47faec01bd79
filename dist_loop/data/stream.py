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

`tf.distribute` calls the dataset function once per input pipeline (worker),
and hands that pipeline's consecutive batches to its local replicas in order,
so pipeline w keeps replicas [w*L, (w+1)*L) of every step.
"""

import numpy as np
import tensorflow as tf

_EPOCHS_FOREVER = np.iinfo(np.int64).max


def _index_stream(num_examples: int, seed: int, start: int) -> tf.data.Dataset:
  """Example indices, epoch after epoch, from stream position `start`."""
  first_epoch, offset = divmod(start, num_examples)

  def epoch(e):
    keys = tf.random.stateless_uniform(
        [num_examples], seed=tf.stack([tf.constant(seed, tf.int64), e]))
    return tf.data.Dataset.from_tensor_slices(tf.argsort(keys))

  return (tf.data.Dataset.range(first_epoch, _EPOCHS_FOREVER)
          .flat_map(epoch).skip(offset))


def _fixed(ds: tf.data.Dataset) -> tf.data.Dataset:
  """`ds` without tf.data's autotuning model.

  Its optimisation thread sleeps up to 60 s between rounds, and freeing an
  iterator waits for it, so closing a run's input could take a minute. The
  pipeline is a gather per batch; the AUTOTUNE values still fall back to
  TensorFlow's defaults (parallel calls up to the cores, a prefetch buffer
  that grows when it runs dry). The examples and their order are the same.
  """
  options = tf.data.Options()
  options.autotune.enabled = False
  return ds.with_options(options)


def train_dataset_fn(x: np.ndarray, y: np.ndarray, global_batch_size: int,
                     seed: int, start_step: int = 0):
  """Returns a `dataset_fn(input_context)` for distribute_datasets_from_function.

  Args:
    x, y: the training arrays.
    global_batch_size: examples per step over all replicas.
    seed: fixes the order of every epoch.
    start_step: the first step to produce (for resuming).
  """
  x_t, y_t = tf.constant(x), tf.constant(y)

  def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
    replicas = ctx.num_replicas_in_sync
    per_replica = ctx.get_per_replica_batch_size(global_batch_size)
    local = replicas // ctx.num_input_pipelines
    ds = _index_stream(len(x), seed, start_step * global_batch_size)
    ds = ds.batch(per_replica, drop_remainder=True)
    if ctx.num_input_pipelines > 1:
      first = ctx.input_pipeline_id * local
      ds = (ds.batch(replicas, drop_remainder=True)
            .map(lambda group: group[first:first + local]).unbatch())
    ds = ds.map(lambda idx: (tf.gather(x_t, idx), tf.gather(y_t, idx)),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return _fixed(ds.prefetch(tf.data.AUTOTUNE))

  return dataset_fn


def eval_dataset(x: np.ndarray, y: np.ndarray, batch_size: int) -> tf.data.Dataset:
  """The held-out split, in order, last partial batch kept."""
  return _fixed(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
                .prefetch(tf.data.AUTOTUNE))
