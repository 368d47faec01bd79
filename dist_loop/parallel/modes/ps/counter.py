"""An atomic fetch-and-add, for a counter that several workers move at once.

The per-worker input numbers its shards with it (`PSTrainer._dataset_fn`).
"""

import tensorflow as tf

_INT64_MAX = 2**63 - 1


def fetch_add(variable: tf.Variable) -> tf.Tensor:
  """Adds 1 to an int64 resource variable; returns the value before, atomically.

  `assign_add(1)` followed by a read is two ops, so two workers can read the
  same value. `ResourceCountUpTo` increments and returns under the
  variable's own mutex, so every caller gets a different value.

  Args:
    variable: an int64 `tf.Variable` (on any device, e.g. a PS).

  Returns:
    The int64 scalar value before the increment.
  """
  return tf.raw_ops.ResourceCountUpTo(resource=variable.handle,
                                      limit=_INT64_MAX, T=tf.int64)
