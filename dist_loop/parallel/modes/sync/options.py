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

  straggler: Optional[str] = straggler_option()
