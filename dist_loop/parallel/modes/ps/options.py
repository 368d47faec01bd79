"""The flags of --mode=ps."""

import dataclasses

from dist_loop.core.options import option
from dist_loop.parallel import staleness


@dataclasses.dataclass(frozen=True)
class PSOptions:
  """How the chief schedules work on the workers, and the staleness bound."""

  max_staleness: int = staleness.bound_option()
  ps_steps_per_call: int = option(
      4, "Steps one scheduled function runs on a worker per call.", lower=1)
