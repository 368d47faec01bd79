"""dist_loop.parallel.staleness: the bound, the float16 overflow rule, the histogram."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from dist_loop import UserError
from dist_loop.core import options
from dist_loop.parallel import staleness
from dist_loop.parallel.staleness import MAX_TRACKED, NO_BOUND, Histogram


def test_the_bound_drops_only_gradients_staler_than_it():
  assert all(staleness.accepts(tau, NO_BOUND) for tau in (0, 1, 10**6))
  assert [staleness.accepts(tau, 2) for tau in range(5)] == [
      True, True, True, False, False]
  assert staleness.accepts(0, 0) and not staleness.accepts(1, 0)


def test_the_bound_option_allows_no_bound_and_nothing_below():
  @dataclasses.dataclass(frozen=True)
  class Opts:
    max_staleness: int = staleness.bound_option()

  (spec,) = options.specs(Opts)
  assert (spec.name, spec.default, spec.lower) == ("max_staleness", NO_BOUND,
                                                   NO_BOUND)
  options.check(Opts(max_staleness=0))
  with pytest.raises(UserError, match="--max_staleness must be >= -1"):
    options.check(Opts(max_staleness=-2))


@pytest.mark.parametrize(
    "finite,loss_finite,computed_at,current,skip,halve", [
        (True, True, 8.0, 8.0, False, False),  # A good gradient.
        (False, True, 8.0, 8.0, True, True),  # Overflow at the scale in force.
        (False, True, 4.0, 8.0, True, True),  # At a smaller scale: halve too.
        (False, True, 16.0, 8.0, True, False),  # Already halved for: skip.
        (False, False, 8.0, 8.0, False, False),  # A non-finite loss: an error.
        (False, True, 1.0, 1.0, False, False),  # At the floor: an error.
        (False, True, 2.0, 1.0, True, False),  # Older, floor since: skip.
    ])
def test_overflow_rule(finite, loss_finite, computed_at, current, skip,
                       halve):
  got = staleness.overflow(tf.constant(finite), tf.constant(loss_finite),
                           tf.constant(computed_at), tf.constant(current))
  assert (bool(got[0]), bool(got[1])) == (skip, halve)


def test_histogram_statistics():
  h = Histogram()
  assert (h.total, h.mean, h.max, h.by_tau()) == (0, None, None, {})
  assert h.scalars("async") == {"async/staleness_mean": 0.0,
                                "async/staleness_max": 0.0}
  assert h.samples().size == 0
  h.add([0, 2, 2, 3])
  assert (h.total, h.mean, h.max) == (4, 7 / 4, 3)
  assert h.by_tau() == {0: 1, 2: 2, 3: 1}
  np.testing.assert_array_equal(h.samples(), [0, 2, 2, 3])
  assert h.samples().dtype == np.float32
  assert h.scalars("ps") == {"ps/staleness_mean": 1.75,
                             "ps/staleness_max": 3.0}
  assert h.summary("async") == {
      "async_staleness_mean": 1.75, "async_staleness_max": 3,
      "async_staleness_counts": {"0": 1, "2": 2, "3": 1}}
  with pytest.raises(ValueError, match=">= 0"):
    h.add([-1])


def test_histogram_counts_by_bin_and_merges():
  h = Histogram()
  counts = np.zeros(MAX_TRACKED + 1, np.int64)
  counts[[1, 5]] = [3, 1]
  h.add_counts(counts)
  h.add_counts(counts)
  assert h.by_tau() == {1: 6, 5: 2}
  assert (h.mean, h.max) == (16 / 8, 5)
  other = Histogram()
  other.add([7])
  h.merge(other)
  assert (h.total, h.max, h.by_tau()[7]) == (9, 7, 1)
  assert other.by_tau() == {7: 1}  # Merging leaves the other as it was.


def test_histogram_is_exact_past_its_last_bin():
  h = Histogram()
  h.add([1, MAX_TRACKED + 9, 200])
  assert h.by_tau() == {1: 1, MAX_TRACKED: 2}  # The last bin holds the rest.
  assert h.max == 200 and h.mean == pytest.approx((1 + 72 + 200) / 3)
  merged = Histogram()
  merged.merge(h)
  assert (merged.max, merged.mean) == (h.max, h.mean)
  binned = Histogram()
  binned.add_counts(h.counts)  # Only the bins: the last one counts as 63.
  assert binned.max == MAX_TRACKED
