"""The exact all-reduce, and the casts to a 16-bit wire dtype.

`none` sums the gradients as they are. `fp16` and `bf16` cast each floating
gradient to the wire dtype before the all-reduce and back afterwards, as
Horovod's `Compression.fp16` does: half the bytes on the wire, at the cost
of the cast and of precision in the sum. No state: each step is independent.
"""

from typing import Optional

import tensorflow as tf

from dist_loop.parallel.compression.base import (BucketOptions, COMPRESSORS,
                                                 Compressor, nbytes)


class Cast(Compressor):
  """All gradients in one all-reduce call, in `wire` (None: as they are)."""

  Options = BucketOptions
  wire: Optional[tf.DType] = None

  def _wire_dtype(self, dtype: tf.DType) -> tf.DType:
    return self.wire if self.wire is not None and dtype.is_floating else dtype

  def reduce(self, grads, state, step):
    del step
    sent = [tf.cast(g, self._wire_dtype(g.dtype)) for g in
            (tf.convert_to_tensor(g) for g in grads)]
    reduced = self.all_reduce(sent)
    return [tf.cast(r, g.dtype) for r, g in zip(reduced, grads)], state

  def wire_bytes(self) -> int:
    return sum(nbytes(s, self._wire_dtype(d))
               for s, d in zip(self.shapes, self.dtypes))


@COMPRESSORS.register("none")
class Exact(Cast):
  """The exact all-reduce: gradients in their own dtype (float32)."""


@COMPRESSORS.register("fp16")
class Float16(Cast):
  """IEEE half precision on the wire (5 exponent bits: may overflow)."""

  wire = tf.float16


@COMPRESSORS.register("bf16")
class BFloat16(Cast):
  """bfloat16 on the wire (float32's range, 8 bits of mantissa)."""

  wire = tf.bfloat16
