"""The flags of --mode=local_sgd (local SGD and DiLoCo)."""

import dataclasses

from dist_loop.core.options import option

OUTER_OPTIMIZERS = ("average", "nesterov")


@dataclasses.dataclass(frozen=True)
class LocalSGDOptions:
  """How often the replicas synchronise, and the outer optimizer.

  The defaults are plain periodic model averaging; DiLoCo is
  `--outer_optimizer=nesterov --outer_learning_rate=0.7 --outer_momentum=0.9`
  with `--optimizer=adam` inside.
  """

  sync_every: int = option(
      8, "Inner steps each replica takes on its own weights between two "
      "synchronisations (H).", lower=1)
  outer_optimizer: str = option(
      "average", "How the averaged pseudo-gradient (synchronised weights "
      "minus a replica's) moves the synchronised weights: average (SGD; "
      "outer lr 1 is plain model averaging) or nesterov (DiLoCo).",
      choices=OUTER_OPTIMIZERS, layout=True)
  outer_learning_rate: float = option(
      1.0, "Learning rate of the outer optimizer (DiLoCo: 0.7).", above=0.0)
  outer_momentum: float = option(
      0.0, "Momentum of --outer_optimizer=nesterov (DiLoCo: 0.9); must be "
      "0 with average.", lower=0.0, upper=1.0)
