"""The outcomes of --mode=ps updates: a vector on the PS, and its reading.

A scheduled call returns nothing (the chief copies no result from a worker),
so each step adds its record to one float64 vector on the PS, under the
update lock (`update.py`), and the chief reads the vector between rounds.
The layout:

    [applied, dropped, skipped, nonfinite]        counts of steps
    [tau = 0, 1, ..., MAX_TRACKED or more]        staleness of applied updates
    [loss, <metrics...>, grad_norm]               sums over applied updates

float64 counts are exact up to 2**53. The last bin counts every larger tau
as MAX_TRACKED, in the mean and max too. On the chief, a `Record` turns the
vector into counts, a `staleness.Histogram` and means, `call_metrics` into
what `train` returns, and `Totals` keeps what the run reports beyond one
`train` call.
"""

import dataclasses
from typing import Dict, Mapping, Sequence

import numpy as np
import tensorflow as tf

from dist_loop.parallel import staleness
from dist_loop.parallel.modes.base import train_metrics

# applied: the update was applied (and counted in `step`); dropped: staler
# than --max_staleness; skipped: a float16 overflow; nonfinite: a real
# non-finite gradient. A step past the call's budget is none of these.
COUNTS = ("applied", "dropped", "skipped", "nonfinite")
BINS = staleness.MAX_TRACKED + 1


@dataclasses.dataclass
class Record:
  """The counts and sums of one `train` call, read on the chief."""

  counts: Dict[str, int]
  staleness: staleness.Histogram
  sums: Dict[str, float]

  def means(self) -> Dict[str, float]:
    """Each sum over the applied updates, divided by their number; empty
    if none was applied."""
    n = self.counts["applied"]
    return {k: v / n for k, v in self.sums.items()} if n else {}


class Layout:
  """The positions in the vector, for a task's metrics."""

  def __init__(self, metric_names: Sequence[str]):
    self.sums = tuple(metric_names) + ("grad_norm",)
    self.size = len(COUNTS) + BINS + len(self.sums)

  def record(self, outcome: Mapping[str, tf.Tensor], tau: tf.Tensor,
             metrics: Mapping[str, tf.Tensor]) -> tf.Tensor:
    """One step's record, to add to the vector (in graph).

    Args:
      outcome: a boolean scalar per name in `COUNTS`.
      tau: the int64 staleness of the step's gradient.
      metrics: a float scalar per name in `self.sums`.
    """
    counts = tf.cast(tf.stack([outcome[k] for k in COUNTS]), tf.float64)
    of_applied = tf.concat([
        tf.one_hot(tf.minimum(tau, BINS - 1), BINS, dtype=tf.float64),
        tf.cast(tf.stack([metrics[k] for k in self.sums]), tf.float64)], 0)
    # `where`, not `0 *`: a skipped overflow's grad_norm is inf, 0 * inf NaN.
    return tf.concat([counts, tf.where(outcome["applied"], of_applied,
                                       tf.zeros_like(of_applied))], 0)

  def read(self, vector: np.ndarray) -> Record:
    """The vector, as read from the PS, as a `Record`."""
    vector = np.asarray(vector, np.float64)
    if vector.shape != (self.size,):
      raise ValueError(f"expected {self.size} stats, got {vector.shape}")
    counts, bins = vector[:len(COUNTS)], vector[len(COUNTS):-len(self.sums)]
    histogram = staleness.Histogram()
    histogram.add_counts(bins.astype(np.int64))
    return Record(
        counts={k: int(v) for k, v in zip(COUNTS, counts)},
        staleness=histogram,
        sums=dict(zip(self.sums, vector[-len(self.sums):].tolist())))


def call_metrics(task, record: Record, loss_scale=None) -> Dict[str, float]:
  """What the chief's `train` returns: the metric tail every mode shares
  (`base.train_metrics`) over the call's applied updates, and the drops.

  A skipped push (float16 overflow) does not advance `step`, so it is not a
  step: `train/skipped_steps` is always 0 (`ps/skipped_pushes` counts them).
  """
  extra = {"ps/drops_per_update": (record.counts["dropped"]
                                   / max(record.counts["applied"], 1))}
  if loss_scale is not None:
    extra["loss_scale"] = float(loss_scale.scale.numpy())
  return train_metrics(task, record.means(), extra=extra)


class Totals:
  """The chief's running totals over the run, and the staleness histogram of
  the updates since the last log line."""

  def __init__(self):
    self.dropped = 0
    self.skipped_pushes = 0
    self.staleness = staleness.Histogram()  # The whole run.
    self._window = staleness.Histogram()  # Since `take_window`.

  def add(self, record: Record) -> None:
    self.dropped += record.counts["dropped"]
    self.skipped_pushes += record.counts["skipped"]
    self.staleness.merge(record.staleness)
    self._window.merge(record.staleness)

  def take_window(self) -> staleness.Histogram:
    """The histogram since the last call; starts a new one."""
    window, self._window = self._window, staleness.Histogram()
    return window

  def scalars(self) -> Dict[str, float]:
    """Running totals: `ps/dropped`, `ps/skipped_pushes` (float16
    overflows; a skipped push is not a step)."""
    return {"ps/dropped": float(self.dropped),
            "ps/skipped_pushes": float(self.skipped_pushes)}

  def summary(self) -> Dict[str, object]:
    """summary.json entries: the totals and the run's staleness."""
    return {"ps_dropped": self.dropped,
            "ps_skipped_pushes": self.skipped_pushes,
            **self.staleness.summary("ps")}
