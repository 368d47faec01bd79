"""The flags of --mode=sync."""

import dataclasses
from typing import Optional

from dist_loop.core.options import option
from dist_loop.parallel.compression import COMPRESSORS
from dist_loop.parallel.straggler import straggler_option

# The default bucket (how buckets travel:
# `dist_loop/parallel/compression/base.py`). 4 MB cuts the 3-8 MB gradients of
# the benchmark models into a few buckets, so they can travel during the backward pass; DDP's 25 MB would
# leave them in one. Across two processes on this project's 2-core machine
# it measured within the spread of one bucket, and 1 MB buckets (one more
# round trip each) slowest (docs/benchmarks.md, "Scaling across processes").
BUCKET_MB = 4.0


@dataclasses.dataclass(frozen=True)
class SyncOptions:
  """How the one explicit all-reduce of a synchronous step is done.

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
