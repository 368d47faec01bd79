"""Compression of the explicit all-reduce: a registry of compressors.

A `Compressor` decides what crosses the wire: `none` (the exact sum),
`fp16` and `bf16` (casts), `powersgd` (low rank, error feedback) and `topk`
(sparse, error feedback). The reducers (`dist_loop/parallel/reducers`)
select one: `--reducer=exact|cast|powersgd|topk`, or an extension's. See
`base.py` for the interface, `state.py` for the per-replica state, and
`wire.py` for the byte counts every all-reducing mode reports.
"""

from dist_loop.parallel.compression import cast, powersgd, topk  # Register them.
from dist_loop.parallel.compression import wire
from dist_loop.runtime import user_code
from dist_loop.parallel.compression.base import (
    BUCKET_MB, COMPRESSORS, BucketOptions, Compressor, is_compressible,
    matrix_shape, nbytes, pack, unpack)
from dist_loop.parallel.compression.state import State


def make(compressor_class, options, variables, seed: int = 0) -> Compressor:
  """A `compressor_class` with its `options`, for gradients of
  `variables`; an extension's `reduce` is converted by AutoGraph."""
  compressor = compressor_class(options, variables, seed)
  user_code.convert_method(compressor, "reduce")  # An extension's: AutoGraph.
  return compressor


__all__ = ["BUCKET_MB", "BucketOptions", "COMPRESSORS", "Compressor", "State",
           "cast", "is_compressible", "make", "matrix_shape", "nbytes", "pack",
           "powersgd", "topk", "unpack", "wire"]
