"""Per-replica variables under a mirrored strategy, and their checkpoint.

A `MirroredVariable` has one component per replica. Every other mode writes
the components alike, so they are copies; local SGD uses them as per-replica
storage instead. In replica context a read sees the replica's own component,
and `write` (like `optim.apply_reduced`) goes through
`strategy.extended.update`, which hands each component its own replica's
value: the components then hold different values, one per replica, with no
collective. This works the same under MultiWorkerMirroredStrategy, where a
process holds the components of its own replicas.

A checkpoint of a mirrored variable holds one component (the first
replica's). `ReplicaState` holds the others: when a checkpoint is saved it
gathers every replica's component of each variable into one array
[replicas, ...], and when one is restored it keeps the arrays until `apply`
writes each replica's row back into its component. In one process
(MirroredStrategy) every component is local, so both read and write the
components directly; across processes the gather is a collective (every
worker saves together, as MultiWorkerMirroredStrategy requires) and the
write a replica step, each traced once.
"""

import io
from typing import List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from dist_loop.core.errors import UserError
from dist_loop.runtime import strategy as strategy_lib


def backing(v):
  """A Keras 3 variable's backing tf.Variable (mirrored under a strategy)."""
  return getattr(v, "value", v) if isinstance(v, keras.Variable) else v


def write(variables: Sequence, values: Sequence[tf.Tensor]) -> None:
  """From replica context: each replica's `values` into its own components
  of `variables` (no collective)."""

  def update(strategy, variables, values):
    for var, value in zip(variables, values):
      strategy.extended.update(
          var, lambda c, x: c.assign(x, read_value=False), args=(value,),
          group=False)

  strategy_lib.cross_replica_call(update, [backing(v) for v in variables],
                                  list(values))


class ReplicaState(tf.train.experimental.PythonState):
  """Every replica's value of `variables`, as one checkpoint entry.

  The entry is an `.npz` archive of one array per variable, [replicas, ...]
  in the order of the strategy's replica ids.
  """

  def __init__(self, strategy: tf.distribute.Strategy, variables: Sequence,
               collective: Optional[bool] = None):
    """`collective`: gather and write in replica steps (None: only when
    some replicas live in other processes; True tests that path)."""
    self._strategy = strategy
    self._variables = [backing(v) for v in variables]
    self._pending = None
    if collective is None:
      collective = not isinstance(strategy, tf.distribute.MirroredStrategy)
    self._collective = collective
    self._gather = tf.function(self._gather_fn, autograph=False)
    self._scatter = tf.function(self._scatter_fn, autograph=False)

  @property
  def pending(self) -> bool:
    """Whether a restored state waits for `apply`."""
    return self._pending is not None

  def values(self) -> List[np.ndarray]:
    """Each variable's components, stacked: [replicas, ...]."""
    if self._pending is not None:
      return list(self._pending)
    if not self._collective:
      return [np.stack([c.numpy() for c in self._components(v)])
              for v in self._variables]
    out = self._gather()
    return [np.asarray(v) for v in
            tf.nest.map_structure(
                lambda t: self._strategy.experimental_local_results(t)[0],
                out)]

  def serialize(self) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, *self.values())
    return buffer.getvalue()

  def deserialize(self, string_value) -> None:
    """Keeps the restored arrays for `apply` (the restore may not have
    reached the variables' other entries yet).

    Raises:
      UserError: the checkpoint was written with another replica count.
      ValueError: the entry does not match the variables (another model).
    """
    with np.load(io.BytesIO(string_value), allow_pickle=False) as archive:
      arrays = [archive[f"arr_{i}"] for i in range(len(archive.files))]
    if len(arrays) != len(self._variables):
      raise ValueError(f"{len(arrays)} per-replica variables in the "
                       f"checkpoint, {len(self._variables)} in the run")
    replicas = self._strategy.num_replicas_in_sync
    if arrays and arrays[0].shape[0] != replicas:
      raise UserError(
          f"the checkpoint holds the weights of {arrays[0].shape[0]} "
          f"replicas, this run has {replicas}; resume with "
          f"{arrays[0].shape[0]} replicas, or use a new --workdir")
    for array, var in zip(arrays, self._variables):
      if array.shape[1:] != tuple(var.shape):
        raise ValueError(f"per-replica {var.name} has shape "
                         f"{array.shape[1:]}, the run's {var.shape}")
    self._pending = arrays

  def apply(self) -> None:
    """Writes a restored state into the replicas' components, once."""
    if self._pending is None:
      return
    if self._collective:
      self._scatter([tf.constant(a) for a in self._pending])
    else:
      for var, array in zip(self._variables, self._pending):
        for component, row in zip(self._components(var), array):
          component.assign(row, read_value=False)
    self._pending = None

  def _components(self, var):
    """`var`'s components in replica-id order (all local: one process)."""
    return self._strategy.experimental_local_results(var)

  def _gather_fn(self):
    def gather():
      ctx = tf.distribute.get_replica_context()
      return ctx.all_gather([tf.expand_dims(tf.identity(v), 0)
                             for v in self._variables], axis=0)
    return self._strategy.run(gather)

  def _scatter_fn(self, stacks):
    def scatter(stacks):
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      write(self._variables, [tf.gather(s, replica) for s in stacks])
    self._strategy.run(scatter, args=(stacks,))
