"""PowerSGD: rank-r compression with error feedback (Vogels et al., 2019).

For each matrix-shaped gradient (`base.matrix_shape`: a kernel's inputs by
its outputs, n x m), replica i adds its residual to its gradient, M_i =
G_i + E_i, and, with Q (m x r) the same on every replica:

1. P = SUM_i M_i Q            (all-reduce of n x r)
2. P <- orthonormal basis of P's columns (QR)
3. Q = SUM_i M_i^T P          (all-reduce of m x r)
4. the result is P Q^T = P P^T SUM_i M_i, and replica i keeps the
   residual E_i <- M_i - P P^T M_i (what it did not send: error feedback).

Q is warm-started: the next step starts from this step's Q, so successive
steps refine the same subspace (one power iteration per step). The rank
used is min(r, n, m); at full rank P P^T is the projection onto the column
space of SUM_i M_i Q, which is SUM_i M_i's when Q is invertible there, so
the sum is exact. Vectors (biases) and tiny tensors (`MIN_ELEMENTS`) are
summed exactly, packed into one vector that travels with the P's.

`--powersgd_start_step=s` sums steps 0..s-1 exactly (a warm-up; the
trainer switches, see `Compressor.exact_steps`): residuals and Q start
being used at step s.
"""

import dataclasses
from typing import List, Tuple

import numpy as np
import tensorflow as tf

from dist_loop.core.options import option
from dist_loop.parallel.compression import base
from dist_loop.parallel.compression.base import COMPRESSORS, Compressor


@dataclasses.dataclass(frozen=True)
class PowerSGDOptions:
  """The flags of `--reducer=powersgd`."""

  powersgd_rank: int = option(
      4, "Rank of PowerSGD's factors P and Q.", lower=1, layout=True)
  powersgd_start_step: int = option(
      0, "PowerSGD sums the steps before this one exactly (a warm-up).",
      lower=0)


@COMPRESSORS.register("powersgd")
class PowerSGD(Compressor):
  """Rank-`--powersgd_rank` PowerSGD on every matrix; the rest exact."""

  Options = PowerSGDOptions
  takes_buckets = False  # Its collectives need every gradient first.
  # Smaller matrices gain little and would cost two more collectives.
  MIN_ELEMENTS = 1024

  def __init__(self, options, variables, seed=0):
    super().__init__(options, variables, seed)
    self.rank = options.powersgd_rank
    self.exact_steps = options.powersgd_start_step
    compressed = [base.is_compressible(s, self.MIN_ELEMENTS)
                  for s in self.shapes]
    self.matrices = [i for i, c in enumerate(compressed) if c]
    self.vectors = [i for i, c in enumerate(compressed) if not c]

  def factor_shapes(self) -> List[Tuple[int, int, int]]:
    """(n, m, rank) of each compressed matrix."""
    out = []
    for i in self.matrices:
      n, m = base.matrix_shape(self.shapes[i])
      out.append((n, m, min(self.rank, n, m)))
    return out

  def initial_state(self):
    """Zero residuals; Q drawn from the run's seed (alike everywhere)."""
    rng = np.random.RandomState(self.seed)
    return {
        "residual": [np.zeros(self.shapes[i].as_list(),
                              self.dtypes[i].as_numpy_dtype)
                     for i in self.matrices],
        "q": [rng.standard_normal((m, r)).astype(np.float32)
              for _, m, r in self.factor_shapes()],
    }

  def reduce(self, grads, state, step):
    del step
    out = list(grads)
    ms = [tf.reshape(grads[i] + e, (n, m)) for i, e, (n, m, _) in
          zip(self.matrices, state["residual"], self.factor_shapes())]
    ps = [tf.matmul(tf.cast(mi, tf.float32), q)
          for mi, q in zip(ms, state["q"])]
    dense = [grads[i] for i in self.vectors]
    first = self.all_reduce(([base.pack(dense)] if dense else []) + ps)
    if dense:
      for i, g in zip(self.vectors,
                      base.unpack(first.pop(0), [self.shapes[i]
                                                 for i in self.vectors])):
        out[i] = g
    ps = [tf.linalg.qr(p).q for p in first]  # Orthonormal columns.
    local_qs = [tf.matmul(tf.cast(mi, tf.float32), p, transpose_a=True)
                for mi, p in zip(ms, ps)]
    qs = self.all_reduce(local_qs)
    residuals = []
    for i, mi, p, q, local_q in zip(self.matrices, ms, ps, qs, local_qs):
      dtype = self.dtypes[i]
      out[i] = tf.reshape(tf.cast(tf.matmul(p, q, transpose_b=True), dtype),
                          self.shapes[i])
      sent = tf.cast(tf.matmul(p, local_q, transpose_b=True), dtype)
      residuals.append(tf.reshape(mi - sent, self.shapes[i]))
    return out, {"residual": residuals, "q": qs}

  def wire_bytes(self) -> int:
    dense = sum(base.nbytes(self.shapes[i], self.dtypes[i])
                for i in self.vectors)
    factors = sum((n + m) * r for n, m, r in self.factor_shapes())
    return dense + factors * tf.float32.size
