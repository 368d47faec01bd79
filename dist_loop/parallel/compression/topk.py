"""Top-k sparsification with error feedback.

Each replica adds its residual to each matrix-shaped gradient and sends only
the k = ceil(`--topk_fraction` x size) entries of largest magnitude: their
values and their indices, gathered from every replica (an all-gather, since
the replicas pick different entries), and every replica rebuilds the same
dense sum by adding what it gathered into zeros (entries picked by several
replicas add up). What a replica did not send stays in its residual and is
added to its next gradient. Vectors and tiny tensors are summed exactly, in
one packed all-reduce. With fraction 1 every entry is sent: the exact sum.
"""

import dataclasses
import math

import numpy as np
import tensorflow as tf

from dist_loop.core.options import option
from dist_loop.parallel.compression import base
from dist_loop.parallel.compression.base import COMPRESSORS, Compressor

INDEX_DTYPE = tf.int32


@dataclasses.dataclass(frozen=True)
class TopKOptions:
  """The flags of `--reducer=topk`."""

  topk_fraction: float = option(
      0.01, "Fraction of each matrix's entries that top-k sends, per "
      "replica (1 is exact).", above=0.0, upper=1.0)


@COMPRESSORS.register("topk")
class TopK(Compressor):
  """The largest `--topk_fraction` of each matrix, per replica."""

  Options = TopKOptions
  takes_buckets = False  # Its collectives need every gradient first.
  MIN_ELEMENTS = 1024  # As PowerSGD's: below it, the exact sum is cheap.

  def __init__(self, options, variables, seed=0):
    super().__init__(options, variables, seed)
    compressed = [base.is_compressible(s, self.MIN_ELEMENTS)
                  for s in self.shapes]
    self.sparse = [i for i, c in enumerate(compressed) if c]
    self.dense = [i for i, c in enumerate(compressed) if not c]
    sizes = [self.shapes[i].num_elements() for i in self.sparse]
    # Rounded first, so that a fraction of 1 keeps every entry.
    self.ks = [max(1, math.ceil(round(options.topk_fraction * n, 6)))
               for n in sizes]
    self.sizes = sizes
    self.offsets = [int(o) for o in np.cumsum([0] + sizes[:-1])]

  def initial_state(self):
    return {"residual": [np.zeros(self.shapes[i].as_list(),
                                  self.dtypes[i].as_numpy_dtype)
                         for i in self.sparse]}

  def reduce(self, grads, state, step):
    del step
    out = list(grads)
    if self.dense:
      summed = self.all_reduce([base.pack([grads[i] for i in self.dense])])
      for i, g in zip(self.dense, base.unpack(
          summed[0], [self.shapes[i] for i in self.dense])):
        out[i] = g
    if not self.sparse:
      return out, state
    flats = [tf.reshape(grads[i] + e, [-1])
             for i, e in zip(self.sparse, state["residual"])]
    values, indices = [], []
    for flat, k, offset in zip(flats, self.ks, self.offsets):
      _, picked = tf.math.top_k(tf.abs(flat), k, sorted=False)
      values.append(tf.gather(flat, picked))
      indices.append(tf.cast(picked, INDEX_DTYPE) + offset)
    values, indices = tf.concat(values, 0), tf.concat(indices, 0)
    total = sum(self.sizes)
    summed = tf.scatter_nd(self.all_gather(indices)[:, None],
                           self.all_gather(values), [total])
    mine = tf.scatter_nd(indices[:, None], values, [total])
    residuals = []
    for i, flat, s, m in zip(self.sparse, flats, tf.split(summed, self.sizes),
                             tf.split(mine, self.sizes)):
      out[i] = tf.reshape(s, self.shapes[i])
      residuals.append(tf.reshape(flat - m, self.shapes[i]))
    return out, {"residual": residuals}

  def wire_bytes(self) -> int:
    dense = sum(base.nbytes(self.shapes[i], self.dtypes[i])
                for i in self.dense)
    picked = sum(k * (self.dtypes[i].size + INDEX_DTYPE.size)
                 for i, k in zip(self.sparse, self.ks))
    return dense + picked
