"""Staleness, shared by the asynchronous modes (async threads and ps).

A gradient computed on master version v and offered at version t has
staleness tau = t - v, where the version is the number of applied updates.
This module holds what both modes mean by it:

* the bound: `--max_staleness=s` drops a gradient with tau > s (-1: none);
* the float16 overflow rule for a gradient computed at an older loss scale;
* the statistics: a histogram of tau over applied updates, with the same
  TensorBoard tags and summary.json entries in both modes.
"""

from typing import Dict, Iterable, Optional

import numpy as np
import tensorflow as tf

from dist_loop.core.options import option

NO_BOUND = -1
# The histogram's last bin counts every tau >= MAX_TRACKED.
MAX_TRACKED = 63


def bound_option():
  """The `--max_staleness` option, declared alike by every async mode."""
  return option(NO_BOUND, "Async and ps: drop gradients more than this many "
                "updates stale (-1: no bound).", lower=NO_BOUND)


def accepts(tau: int, max_staleness: int) -> bool:
  """Whether a gradient of staleness `tau` is applied (else dropped)."""
  return max_staleness == NO_BOUND or tau <= max_staleness


def overflow(finite, loss_finite, computed_at, current):
  """The loss-scale rule for one gradient computed at scale `computed_at`
  while `current` is in force.

  Without an all-reduce, each gradient comes at the scale its worker read.
  Non-finite gradients of a finite loss are an overflow, to skip; only one
  computed at the scale in force (or a smaller one) halves it, so W workers
  that overflowed at one scale halve it once, not W times. At the floor
  scale 1.0 nothing is left to unscale: the step is really non-finite.

  Args: boolean and float32 scalar tensors.

  Returns:
    (skip, halve): skip the gradient as an overflow; halve the scale.
  """
  over = tf.logical_and(tf.logical_not(finite), loss_finite)
  older = computed_at > current  # Already answered by a halving.
  halve = over & tf.logical_not(older) & (current > 1.0)
  return over & (older | halve), halve


class Histogram:
  """Counts of tau over applied updates: bins 0..MAX_TRACKED (the last
  one holds every larger tau).

  Taus given one by one (`add`) keep an exact mean and max even past the
  last bin; counts given by bin (`add_counts`) count each bin's tau.
  """

  def __init__(self):
    self.counts = np.zeros(MAX_TRACKED + 1, np.int64)
    # Taus that `add` put in the last bin: their sum beyond MAX_TRACKED, and
    # the largest, so that mean and max stay exact.
    self._beyond = 0
    self._top = MAX_TRACKED

  def add(self, taus: Iterable[int]) -> None:
    for tau in taus:
      tau = int(tau)
      if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")
      self.counts[min(tau, MAX_TRACKED)] += 1
      if tau > MAX_TRACKED:
        self._beyond += tau - MAX_TRACKED
        self._top = max(self._top, tau)

  def add_counts(self, counts: np.ndarray) -> None:
    """Adds counts by bin (MAX_TRACKED + 1 of them)."""
    self.counts += np.asarray(counts, np.int64)

  def merge(self, other: "Histogram") -> None:
    """Adds another histogram, keeping its exact mean and max."""
    self.counts += other.counts
    self._beyond += other._beyond  # pylint: disable=protected-access
    self._top = max(self._top, other._top)  # pylint: disable=protected-access

  @property
  def total(self) -> int:
    return int(self.counts.sum())

  @property
  def mean(self) -> Optional[float]:
    if not self.total:
      return None
    taus = (np.arange(len(self.counts)) * self.counts).sum() + self._beyond
    return float(taus / self.total)

  @property
  def max(self) -> Optional[int]:
    if not self.total:
      return None
    top_bin = int(np.nonzero(self.counts)[0].max())
    return self._top if top_bin == MAX_TRACKED else top_bin

  def by_tau(self) -> Dict[int, int]:
    """{tau: count} of the non-empty bins."""
    return {t: int(c) for t, c in enumerate(self.counts) if c}

  def samples(self) -> np.ndarray:
    """One value per applied update, for a TensorBoard histogram."""
    return np.repeat(np.arange(len(self.counts)),
                     self.counts).astype(np.float32)

  def scalars(self, prefix: str) -> Dict[str, float]:
    """`PREFIX/staleness_mean` and `_max` (0 without updates)."""
    return {f"{prefix}/staleness_mean": self.mean or 0.0,
            f"{prefix}/staleness_max": float(self.max or 0)}

  def summary(self, prefix: str) -> Dict[str, object]:
    """summary.json entries: mean, max and counts by tau (the last bin's
    key counts every larger tau too)."""
    return {
        f"{prefix}_staleness_mean": self.mean,
        f"{prefix}_staleness_max": self.max,
        f"{prefix}_staleness_counts": {str(t): c for t, c in
                                       self.by_tau().items()},
    }
