"""The one explicit all-reduce of the gradients in a synchronous step.

`CommunicationOptions.bytes_per_pack` packs small gradients into larger
chunks (0 lets TensorFlow decide). Compression casts each gradient to fp16 or
bf16 before the reduce and back afterwards: half the bytes on the wire, at the
cost of the cast and of precision in the sum.
"""

from typing import List, Sequence

import tensorflow as tf

WIRE_DTYPES = {"none": None, "fp16": tf.float16, "bf16": tf.bfloat16}


def all_reduce_sum(grads: Sequence[tf.Tensor], compression: str = "none",
                   bytes_per_pack: int = 0) -> List[tf.Tensor]:
  """SUM-reduces `grads` across replicas, once. Call in replica context."""
  ctx = tf.distribute.get_replica_context()
  options = tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=bytes_per_pack)
  wire = WIRE_DTYPES[compression]
  sent = [tf.convert_to_tensor(g) for g in grads]
  if wire is not None:
    sent = [tf.cast(g, wire) if g.dtype.is_floating else g for g in sent]
  reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, sent, options=options)
  return [tf.cast(r, g.dtype) for r, g in zip(reduced, grads)]
