"""Compression of the explicit all-reduce: a registry of compressors.

`--allreduce_compression=NAME` picks a registered `Compressor`: `none` (the
exact sum), `fp16` and `bf16` (casts), `powersgd` (low rank, error feedback)
and `topk` (sparse, error feedback), or one an extension registers. See
`base.py` for the interface, `state.py` for the per-replica state, and
`wire.py` for the byte counts every all-reducing mode reports.
"""

from dist_loop.parallel.compression import cast, powersgd, topk  # Register them.
from dist_loop.parallel.compression import wire
from dist_loop.runtime import user_code
from dist_loop.parallel.compression.base import (COMPRESSORS, Compressor,
                                        check_options, is_compressible,
                                        matrix_shape, nbytes, pack, unpack)
from dist_loop.parallel.compression.state import State


def make(options, variables, seed: int = 0) -> Compressor:
  """The compressor `options.allreduce_compression` names, for gradients
  of `variables`."""
  compressor = COMPRESSORS.get(options.allreduce_compression)(
      options, variables, seed)
  user_code.convert_method(compressor, "reduce")  # An extension's: AutoGraph.
  return compressor


def has_state(options) -> bool:
  """Whether the compressor `options` names keeps a state per replica (an
  `initial_state` of its own: error feedback, PowerSGD's Q)."""
  chosen = COMPRESSORS.get(options.allreduce_compression)
  return chosen.initial_state is not Compressor.initial_state


__all__ = ["COMPRESSORS", "Compressor", "State", "cast", "check_options",
           "has_state", "is_compressible", "make", "matrix_shape", "nbytes",
           "pack", "powersgd", "topk", "unpack", "wire"]
