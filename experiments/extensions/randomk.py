"""Worked example: a new reducer, as one file.

Random-k sparsification with error feedback (Stich et al., 2018, "Sparsified
SGD with memory"). Each step, every replica sends the same random fraction
(`--randomk_fraction`) of each matrix's entries: the replicas draw the positions from the run's
seed and the step number, so they agree on them without exchanging any
indices, and the picked values go through one ordinary all-reduce together
with the (exact) vectors. Top-k (`--reducer=topk`) picks each
replica's largest entries instead, which must travel with their indices.
As every replica keeps the same positions, the sum of what they send is
what one replica would send of the summed gradients, and the sum of their
residuals evolves as one replica's would: any number of replicas trains
the same weights.
What a replica did not send stays in its residual, per replica, and the
sync trainer checkpoints it like any compressor's state.

Load it with `--user_modules=experiments.extensions.randomk` and select it
with `--reducer=randomk`: `reducers.compressed` makes the compressor a
reducer, and its `Options` its flags (`--randomk_fraction`, listed in
`--helpfull` under `--reducer=randomk`); see `randomk.flags`.
"""

import dataclasses
import math

import numpy as np
import tensorflow as tf

from dist_loop.core.options import option
from dist_loop.parallel import reducers
from dist_loop.parallel.compression import base
from dist_loop.parallel.compression import Compressor

MIN_ELEMENTS = 1024  # Smaller tensors are summed exactly.


@dataclasses.dataclass(frozen=True)
class RandomKOptions:
  """The flags of `--reducer=randomk`."""

  randomk_fraction: float = option(
      0.05, "Fraction of each matrix's entries that random-k sends (the "
      "same positions on every replica; 1 is exact).", above=0.0,
      upper=1.0)


@reducers.compressed("randomk")
class RandomK(Compressor):
  """The same random fraction of each matrix on every replica."""

  Options = RandomKOptions
  takes_buckets = False  # One packed vector of every gradient's sample.

  def __init__(self, options, variables, seed=0):
    super().__init__(options, variables, seed)
    sparse = [base.is_compressible(s, MIN_ELEMENTS) for s in self.shapes]
    self.sparse = [i for i, s in enumerate(sparse) if s]
    self.dense = [i for i, s in enumerate(sparse) if not s]
    fraction = options.randomk_fraction
    self.ks = [max(1, math.ceil(fraction * self.shapes[i].num_elements()))
               for i in self.sparse]

  def initial_state(self):
    return {"residual": [np.zeros(self.shapes[i].as_list(), np.float32)
                         for i in self.sparse]}

  def reduce(self, grads, state, step):
    flats = [tf.reshape(grads[i] + e, [-1])
             for i, e in zip(self.sparse, state["residual"])]
    picks = [self._positions(j, step, flat.shape[0], k)
             for j, (flat, k) in enumerate(zip(flats, self.ks))]
    values = [tf.gather(flat, p) for flat, p in zip(flats, picks)]
    dense = [grads[i] for i in self.dense]
    sent = ([base.pack(dense)] if dense else []) + values
    summed = self.all_reduce([base.pack(sent)])[0]
    sizes = ([sum(self.shapes[i].num_elements() for i in self.dense)]
             if dense else []) + self.ks
    parts = tf.split(summed, sizes)
    out = list(grads)
    if dense:
      for i, g in zip(self.dense, base.unpack(
          parts.pop(0), [self.shapes[i] for i in self.dense])):
        out[i] = g
    residuals = []
    for i, flat, p, mine, total in zip(self.sparse, flats, picks, values,
                                       parts):
      n = [flat.shape[0]]
      out[i] = tf.reshape(tf.scatter_nd(p[:, None], total, n),
                          self.shapes[i])
      residuals.append(tf.reshape(flat - tf.scatter_nd(p[:, None], mine, n),
                                  self.shapes[i]))
    return out, {"residual": residuals}

  def _positions(self, j: int, step, size: int, k: int) -> tf.Tensor:
    """k distinct positions out of `size`, the same on every replica: the
    first k of a random permutation that depends on (seed, matrix, step),
    computed for those k only."""
    seed = tf.stack([tf.constant(self.seed * 1000 + j, tf.int64),
                     tf.cast(step, tf.int64)])
    return tf.random.experimental.index_shuffle(
        tf.range(k, dtype=tf.int64), seed, max_index=size - 1)

  def wire_bytes(self) -> int:
    dense = sum(base.nbytes(self.shapes[i], self.dtypes[i])
                for i in self.dense)
    return dense + sum(k * self.dtypes[i].size
                       for i, k in zip(self.sparse, self.ks))
