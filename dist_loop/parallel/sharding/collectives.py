"""The collectives of a sharded step, and the bytes they move.

TensorFlow has no reduce-scatter on CPU (`CollectiveReduceScatterV2` has
only an NCCL implementation), so `reduce_scatter` is an all-reduce, in the
run's buckets and wire dtype (the compressor's), followed by each replica
keeping its own slice: every replica briefly holds each reduced bucket
whole, and the wire carries twice what a reduce-scatter would.

`gather` brings every replica's flat shard of a group of variables to every
replica in one all-gather per bucket, in the order given (the forward
order for the weights a step is about to use, so that the first layers'
bucket can arrive while the next ones travel).

Bytes. `WireBytes` counts, per replica and step, what a replica hands to
each kind of collective, and what a ring moves for it per replica (the
unit of ZeRO's formulas): an all-reduce of B bytes moves 2B(N-1)/N, a
reduce-scatter of B bytes B(N-1)/N, an all-gather of shards totalling B
bytes B(N-1)/N.
"""

import dataclasses
from typing import List, Sequence

import tensorflow as tf

from dist_loop.parallel.sharding.layout import Layout


def buckets(sizes: Sequence[int], order: Sequence[int],
            bucket_elements: int) -> List[List[int]]:
  """`order` cut into groups of at least `bucket_elements` elements (each
  index weighing `sizes[index]`); one group if `bucket_elements` is 0."""
  if not bucket_elements:
    return [list(order)] if order else []
  groups, total = [], 0
  for index in order:
    if not groups or total >= bucket_elements:
      groups.append([])
      total = 0
    groups[-1].append(index)
    total += sizes[index]
  return groups


def gather(layout: Layout, shards: Sequence[tf.Tensor],
           order: Sequence[int], bucket_elements: int,
           options=None) -> List[tf.Tensor]:
  """Every variable's full value from every replica's shard, in replica
  context. `shards[i]` is this replica's shard of variable i; the result is
  indexed like `shards`."""
  ctx = tf.distribute.get_replica_context()
  out = [None] * len(shards)
  for group in buckets(layout.shard_sizes, order, bucket_elements):
    flat = tf.concat([tf.reshape(shards[i], [-1]) for i in group], axis=0)
    gathered = ctx.all_gather(flat, axis=0, options=options)
    for i, value in zip(group, layout.assemble(gathered, group)):
      out[i] = value
  return out


def reduce_scatter(layout: Layout, reduce_fn, grads: Sequence[tf.Tensor],
                   replica) -> List[tf.Tensor]:
  """This replica's shard of the SUM over replicas of each gradient.

  Args:
    layout: the shards.
    reduce_fn: the all-reduce of a list of gradients (the compressor's).
    grads: this replica's full gradients.
    replica: this replica's index (a tensor under a multi-worker strategy).
  """
  reduced = reduce_fn(list(grads))
  return [layout.shard(i, g, replica) for i, g in enumerate(reduced)]


@dataclasses.dataclass(frozen=True)
class WireBytes:
  """Per replica and step: bytes handed to each kind of collective.

  `gradient_bytes` is what the step's all-reduce (or reduce-scatter) is
  handed, in the wire dtype; `shard_bytes` a replica's float32 flat shard.
  """

  replicas: int
  gradient_bytes: int
  shard_bytes: int
  gathers_per_step: float  # Weight all-gathers per step.

  @property
  def handed(self) -> float:
    """What one replica hands to the collectives in one step."""
    return self.gradient_bytes + self.gathers_per_step * self.shard_bytes

  @property
  def ring(self) -> float:
    """What a ring moves per replica in one step, with the all-reduce that
    stands in for a reduce-scatter on CPU."""
    n = self.replicas
    return ((2 * self.gradient_bytes + self.gathers_per_step * n
             * self.shard_bytes) * (n - 1) / n)

  @property
  def ring_native(self) -> float:
    """The same with a true reduce-scatter (NCCL on GPU)."""
    n = self.replicas
    return ((self.gradient_bytes + self.gathers_per_step * n
             * self.shard_bytes) * (n - 1) / n)
