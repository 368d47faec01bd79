"""The flags of --mode=sync.

How the gradients are reduced is the run's reducer's (`--reducer`, with
its own options: `dist_loop/parallel/reducers`).
"""

import dataclasses
from typing import Optional

from dist_loop.parallel.straggler import straggler_option


@dataclasses.dataclass(frozen=True)
class SyncOptions:
  """Sync mode's own options."""

  An option of a compressor other than the chosen one must keep its default
  (`compression.check_options`): it would be ignored.
  """

  shard: str = option(
      "none", "Divide state among the replicas (ZeRO): none; optimizer "
      "(stage 1: the optimizer's slots); gradients (stage 2: also the "
      "reduced gradients); weights (stage 3: also the weights, gathered for "
      "each step). Checkpoints are the same at every stage and replica "
      "count.", choices=("none", "optimizer", "gradients", "weights"))
  allreduce_bucket_mb: float = option(
      BUCKET_MB, "Gradients travel in buckets of at least this many MB on the "
      "wire, last layers first, each all-reduce depending only on its own "
      "gradients, so it may start during the rest of the backward pass (0: "
      "one bucket, after the whole backward pass). Measured across two "
      "one-core CPU workers: no gain over one bucket, and more exposed time "
      "on deep_mlp (docs/communication.md). For the compressors none, fp16 "
      "and bf16.", lower=0.0, upper=4096.0)
  allreduce_compression: str = option(
      "none", "How gradients travel through the all-reduce: none (exact), "
      "fp16 or bf16 (cast), powersgd (rank --powersgd_rank, error "
      "feedback), topk (--topk_fraction of the entries, error feedback), "
      "or a registered extension.", choices=COMPRESSORS, layout=True)
  powersgd_rank: int = option(
      4, "Rank of PowerSGD's factors P and Q (with "
      "--allreduce_compression=powersgd).", lower=1, layout=True)
  powersgd_start_step: int = option(
      0, "PowerSGD sums the steps before this one exactly (a warm-up).",
      lower=0)
  topk_fraction: float = option(
      0.01, "Fraction of each matrix's entries that top-k sends, per "
      "replica (with --allreduce_compression=topk; 1 is exact).", lower=0.0,
      upper=1.0)
  straggler: Optional[str] = straggler_option()
