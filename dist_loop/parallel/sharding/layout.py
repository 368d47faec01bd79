"""Which part of every variable each replica owns.

Each variable is flattened and padded with zeros to a multiple of the
replica count N; replica r owns the r-th of the N equal slices (its
*shard*). Per variable, not one flat buffer over the model: a shard is then
a slice of one tensor, so the optimizer's slots keep a one-to-one relation
with the model's variables (what makes a sharded checkpoint the same as an
unsharded one, `state.py`), at the cost of up to N - 1 padding elements
per variable.

A replica's shards of all variables, concatenated, are its *flat shard*
(`shard_size` elements): one collective moves every variable's shard at
once. `assemble` undoes `all_gather` of flat shards: the gathered vector
is [N, shard_size], replica by replica, and variable i's full padded value
is column block i read down the replicas.
"""

import dataclasses
import math
from typing import List, Sequence

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Layout:
  """The shards of `shapes` over `replicas`.

  Attributes:
    shapes: each variable's shape.
    replicas: N.
    sizes: each variable's element count.
    shard_sizes: each variable's shard, ceil(size / N) elements.
    offsets: where each variable's shard starts in a flat shard.
  """

  shapes: Sequence[tf.TensorShape]
  replicas: int

  @property
  def sizes(self) -> List[int]:
    return [int(tf.TensorShape(s).num_elements()) for s in self.shapes]

  @property
  def shard_sizes(self) -> List[int]:
    return [math.ceil(n / self.replicas) for n in self.sizes]

  @property
  def offsets(self) -> List[int]:
    out, at = [], 0
    for s in self.shard_sizes:
      out.append(at)
      at += s
    return out

  @property
  def shard_size(self) -> int:
    """Elements of a flat shard (every variable's shard)."""
    return sum(self.shard_sizes)

  @property
  def padding(self) -> int:
    """Zero elements added over all variables to make them divisible."""
    return self.replicas * self.shard_size - sum(self.sizes)

  def shard(self, index: int, value: tf.Tensor, replica) -> tf.Tensor:
    """Replica `replica`'s shard of variable `index`'s `value` (a full
    tensor); `replica` may be a tensor."""
    size, part = self.sizes[index], self.shard_sizes[index]
    flat = tf.reshape(value, [-1])
    padded = tf.pad(flat, [[0, self.replicas * part - size]])
    return tf.reshape(padded, [self.replicas, part])[replica]

  def full(self, index: int, padded: tf.Tensor) -> tf.Tensor:
    """Variable `index`'s value from its padded flat value."""
    return tf.reshape(padded[:self.sizes[index]], self.shapes[index])

  def assemble(self, gathered: tf.Tensor,
               indices: Sequence[int]) -> List[tf.Tensor]:
    """The full values of variables `indices` from an all-gather of flat
    shards that hold exactly those variables' shards, in that order."""
    rows = tf.reshape(gathered, [self.replicas, -1])
    out, at = [], 0
    for i in indices:
      part = self.shard_sizes[i]
      out.append(self.full(i, tf.reshape(rows[:, at:at + part], [-1])))
      at += part
    return out
