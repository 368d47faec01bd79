"""Bytes on the wire, under the same names in every mode that all-reduces.

A mode counts the bytes each replica hands to the collectives that carry the
model's gradients or weights (compressed payloads, vectors, index tensors),
not the few bytes of metrics reduced per loop. It reports them against what
float32 sync hands its all-reduce per step: one float32 per trainable weight.
"""

from typing import Dict, Sequence

import numpy as np


def float32_bytes_per_step(variables: Sequence) -> int:
  """What float32 sync hands its all-reduce per step, per replica."""
  return sum(int(np.prod(v.shape)) * 4 for v in variables)


def scalars(bytes_per_step: float, float32_per_step: float
            ) -> Dict[str, float]:
  """TensorBoard's `comm/` scalars at a log line."""
  return {"comm/bytes_per_step": float(bytes_per_step),
          "comm/ratio_to_float32": bytes_per_step / float32_per_step}


def summary(bytes_per_step: float, bytes_total: float,
            float32_per_step: float) -> Dict[str, float]:
  """summary.json's `allreduce_` entries."""
  return {"allreduce_bytes_per_step": float(bytes_per_step),
          "allreduce_bytes_total": float(bytes_total),
          "allreduce_ratio_to_float32": bytes_per_step / float32_per_step}
