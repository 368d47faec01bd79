"""Sharded weights and optimizer slots, and a checkpoint that does not know.

`ShardedState` holds, per trainable variable, a float32 *shard variable*:
a mirrored variable used as per-replica storage
(`dist_loop/training/replicas.py`), whose component on replica r holds replica
r's shard (`layout.py`). The run's optimizer is built over the shard variables, so its slots are
shard-sized and per replica too: each replica updates its own part of every
variable, and the element-wise update is the same arithmetic as unsharded.

The checkpoint. An unsharded run checkpoints its Keras optimizer, whose
object graph is `_iterations`, `_learning_rate`, `_trainable_variables` (the
model's variables) and `_variables` (iterations, learning rate, then the
slots in build order), each slot a variable of its model variable's shape.
`OptimizerView` has exactly that graph: the model's own variables, and for
each slot a `SlotView` that saves the slot's full value (every replica's
shard, gathered and unpadded) and, on restore, keeps the full value it is
given until `apply` writes each replica's shard of it. So a sharded
checkpoint restores in an unsharded run and the reverse, and at any replica
count: a checkpoint never holds a shard.
"""

import re
from typing import Dict, List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from dist_loop.parallel.sharding.layout import Layout
from dist_loop.training import optim, replicas

_SLOT_OF = re.compile(r"^shard_(\d+)_")


class ShardedState:
  """The shard variables of `model_variables` and an optimizer over them.

  Build outside any `tf.function`. `load` and `apply` run whole
  (`strategy.run` inside); the shard variables are read and written in
  replica context by the step.

  Args:
    strategy: the run's strategy (its replicas are the shards' owners).
    model_variables: the model's trainable variables, full (the values
      shards are cut from; the checkpoint's `_trainable_variables`).
    optimizer: the registered optimizer name; learning_rate: its rate.
    weight_decay: `--weight_decay`; whether a shard decays is decided by
      its model variable's rank (`optim.make`).
  """

  def __init__(self, strategy: tf.distribute.Strategy,
               model_variables: Sequence, optimizer: str,
               learning_rate: float, weight_decay: float = -1.0):
    self.strategy = strategy
    self.model_variables = list(model_variables)
    self.layout = Layout([tf.TensorShape(v.shape) for v in model_variables],
                         strategy.num_replicas_in_sync)
    with strategy.scope():
      self.shards = [
          keras.Variable(initializer="zeros", shape=[size], dtype="float32",
                         name=f"shard_{i}")
          for i, size in enumerate(self.layout.shard_sizes)]
      self.optimizer = optim.make(
          optimizer, learning_rate, self.shards, weight_decay,
          decayed=[len(v.shape) >= 2 for v in self.model_variables])
    self.slots = self.optimizer.variables[2:]  # After iterations and rate.
    self.slot_owner = [_owner(v) for v in self.slots]
    self._pending: Optional[List[np.ndarray]] = None
    self._cache: Dict[str, object] = {}
    self._load = tf.function(self._load_fn, autograph=False)
    self._write_slots = tf.function(self._write_slots_fn, autograph=False)
    self._gather_slots = tf.function(self._gather_slots_fn, autograph=False)
    self.checkpoint = OptimizerView(self)

  # -- the shards of the weights --

  def load(self, values: Optional[Sequence] = None) -> None:
    """Each replica's shards of `values` (default: the model variables)
    into the shard variables: at the start, and after a restore."""
    self._load(list(values if values is not None else self.model_variables))

  def _load_fn(self, values):
    def replica():
      r = tf.distribute.get_replica_context().replica_id_in_sync_group
      replicas.write(self.shards, [
          self.layout.shard(i, tf.convert_to_tensor(v), r)
          for i, v in enumerate(values)])
    self.strategy.run(replica)

  # -- the slots' full values, for the checkpoint --

  def slot_value(self, k: int) -> tf.Tensor:
    """Slot k's full value: every replica's shard, gathered (one collective
    for all slots, cached while the optimizer has not stepped)."""
    if self._pending is not None:
      return tf.constant(self._pending[k])
    now = int(self.optimizer.iterations.numpy())
    if self._cache.get("iterations") != now:
      gathered = self.strategy.experimental_local_results(
          self._gather_slots())[0]
      self._cache = {"iterations": now, "values": [
          v.numpy() for v in self._assemble(gathered)]}
    return tf.constant(self._cache["values"][k])

  def _gather_slots_fn(self):
    def replica():
      flat = tf.concat([tf.reshape(tf.convert_to_tensor(s), [-1])
                        for s in self.slots], axis=0)
      return tf.distribute.get_replica_context().all_gather(
          tf.identity(flat), axis=0)
    return self.strategy.run(replica)

  def _assemble(self, gathered) -> List[tf.Tensor]:
    """Each slot's full value from the gathered slot shards."""
    sizes = [self.layout.shard_sizes[i] for i in self.slot_owner]
    rows = tf.reshape(gathered, [self.layout.replicas, -1])
    out, at = [], 0
    for owner, size in zip(self.slot_owner, sizes):
      padded = tf.reshape(rows[:, at:at + size], [-1])
      out.append(self.layout.full(owner, padded))
      at += size
    return out

  def restore_slot(self, k: int, value: np.ndarray) -> None:
    """Keeps a restored full slot value until `apply`."""
    owner = self.slot_owner[k]
    shape = tuple(self.layout.shapes[owner].as_list())
    if value.shape != shape:
      raise ValueError(f"optimizer slot {self.slots[k].name} has shape "
                       f"{value.shape} in the checkpoint, {shape} in the run")
    if self._pending is None:
      self._pending = [None] * len(self.slots)
    self._pending[k] = value

  def apply(self) -> None:
    """Writes restored slots into the replicas' shards, once."""
    if self._pending is None:
      return
    missing = [self.slots[k].name for k, v in enumerate(self._pending)
               if v is None]
    if missing:
      raise ValueError(f"the checkpoint has no value for {missing[0]}")
    self._write_slots([tf.constant(v) for v in self._pending])
    self._pending = None
    self._cache = {}

  def _write_slots_fn(self, values):
    def replica():
      r = tf.distribute.get_replica_context().replica_id_in_sync_group
      replicas.write(self.slots, [
          self.layout.shard(owner, v, r)
          for owner, v in zip(self.slot_owner, values)])
    self.strategy.run(replica)


def _owner(slot) -> int:
  """The index of the shard variable a slot belongs to, from its name
  (`add_variable_from_reference` names it `<reference>_<slot>`)."""
  match = _SLOT_OF.match(slot.name)
  if match is None:
    raise ValueError(f"cannot tell which variable optimizer slot "
                     f"{slot.name} belongs to")
  return int(match.group(1))


class SlotView(tf.__internal__.tracking.Trackable):
  """One optimizer slot, saved and restored at its full shape."""

  def __init__(self, state: ShardedState, k: int):
    self._state, self._k = state, k

  def _serialize_to_tensors(self):
    return {"VARIABLE_VALUE": self._state.slot_value(self._k)}

  def _restore_from_tensors(self, restored_tensors):
    value = restored_tensors["VARIABLE_VALUE"]
    self._state.restore_slot(self._k, np.asarray(value))
    return tf.no_op()


class OptimizerView(tf.__internal__.tracking.AutoTrackable):
  """What an unsharded run's Keras optimizer checkpoints (see the module
  docstring); also what the run's `optimizer` attribute is."""

  def __init__(self, state: ShardedState):
    opt = state.optimizer
    self._state = state
    self._iterations = opt.variables[0]
    self._learning_rate = opt.variables[1]
    self._trainable_variables = list(state.model_variables)
    self._variables = [self._iterations, self._learning_rate] + [
        SlotView(state, k) for k in range(len(state.slots))]

  @property
  def learning_rate(self):
    return self._state.optimizer.learning_rate

  @property
  def iterations(self):
    return self._state.optimizer.iterations
