"""The flags of --mode=sync."""

import dataclasses
from typing import Optional

from dist_loop.options import option
from dist_loop.straggler import straggler_option

COMPRESSIONS = ("none", "fp16", "bf16")


@dataclasses.dataclass(frozen=True)
class SyncOptions:
  """How the one explicit all-reduce of a synchronous step is done."""

  allreduce_bytes_per_pack: int = option(
      0, "Pack gradients into chunks of this many bytes for the all-reduce "
      "(0: TensorFlow decides).", lower=0)
  allreduce_compression: str = option(
      "none", "Cast gradients to this dtype for the all-reduce.",
      choices=COMPRESSIONS)
  straggler: Optional[str] = straggler_option()
