"""A compressor's state, one value per replica, and its checkpoint entry.

Error-feedback residuals differ from replica to replica. They live in
mirrored variables used as per-replica storage, as local SGD keeps each
replica's weights (`dist_loop/training/replicas.py`): in replica
context a read sees the replica's own component, and `write` hands each
component its own replica's value, with no collective. `checkpoint` is the
entry that saves every replica's value and restores each into its replica
(`ReplicaState`); a restored state reaches the variables at `apply`.
"""

from typing import Optional

import tensorflow as tf

from dist_loop.parallel.compression.base import StateDict
from dist_loop.training import replicas




class State:
  """Per-replica variables holding a compressor's `initial_state`.

  Build it outside any `tf.function`; `read` and `write` run in replica
  context.
  """

  def __init__(self, strategy: tf.distribute.Strategy, initial: StateDict):
    with strategy.scope():
      self.variables = {
          name: [tf.Variable(value, trainable=False,
                             name=f"compression_{name}_{i}")
                 for i, value in enumerate(values)]
          for name, values in initial.items()}
    flat = tf.nest.flatten(self.variables)
    self.checkpoint: Optional[object] = (
        replicas.ReplicaState(strategy, flat) if flat else None)

  def __bool__(self) -> bool:
    return self.checkpoint is not None

  def read(self) -> StateDict:
    """The replica's own values (replica context)."""
    return tf.nest.map_structure(tf.convert_to_tensor, self.variables)

  def write(self, values: StateDict, ok: tf.Tensor) -> None:
    """Each replica's `values` into its own components, if `ok` (a step
    that is not applied leaves the state as it was)."""
    old = tf.nest.flatten(self.variables)
    new = [tf.where(ok, n, tf.convert_to_tensor(o))
           for n, o in zip(tf.nest.flatten(values), old)]
    replicas.write(old, new)

  def apply(self) -> None:
    """Writes a restored checkpoint into the replicas, once."""
    if self.checkpoint is not None:
      self.checkpoint.apply()
