"""The flags of --mode=async."""

import dataclasses
from typing import Optional

from dist_loop.core.options import option
from dist_loop.parallel import staleness
from dist_loop.parallel.modes.asynchronous import policies
from dist_loop.parallel.straggler import straggler_option


@dataclasses.dataclass(frozen=True)
class AsyncOptions:
  """Worker threads and what the applier does with a stale gradient."""

  async_workers: int = option(
      0, "Worker threads, each on its own device (round robin) with its own "
      "model copy and input shard (0: one per device).", lower=0,
      layout=True)
  max_staleness: int = staleness.bound_option()
  staleness_lr: str = option(
      "none", "Registered staleness learning-rate policy: none, inverse "
      "(lr / max(1, tau)), or one an extension adds.",
      choices=policies.STALENESS_LR)
  async_compensation: str = option(
      "none", "Registered delay compensation: none, dc (DC-ASGD).",
      choices=policies.COMPENSATIONS)
  dc_lambda: float = option(
      0.04, "DC-ASGD strength lambda in g + lambda*g*g*(w_now - w_read).",
      lower=0.0)
  straggler: Optional[str] = straggler_option()
