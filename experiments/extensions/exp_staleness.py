"""Worked example: a new staleness policy for the async mode, as one file.

Exponential down-weighting: a gradient that is tau updates stale gets the
learning rate times DECAY**tau. Where `inverse` (Zhang et al., 2016) divides
by tau and so treats tau=1 like a fresh gradient, this discounts every step
of staleness by the same factor, which suits runs where most gradients are
one or two versions old. Select it with `--staleness_lr=exp` (the flag of
`AsyncOptions` takes its choices from the registry, so registering is all it
needs); see `async_exp_staleness.flags`.
"""

from dist_loop.parallel.modes.asynchronous.policies import STALENESS_LR

DECAY = 0.5


@STALENESS_LR.register("exp")
def exponential(tau: int) -> float:
  """lr * DECAY**tau: each version of staleness halves the step."""
  return DECAY ** tau
