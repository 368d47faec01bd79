"""The one-chunk schedules: GPipe, 1F1B, and the 1F1B family's helper.

Each device (stage) holds one chunk and runs F and B. A variant of 1F1B
is its warm-up depths: `warmup_then_alternate` builds the rest (see
experiments/extensions/eager_1f1b.py).
"""

from typing import List

from dist_loop.parallel.modes.pipeline.schedule import (SCHEDULES, Action, B, F,
                                               Schedule)


@SCHEDULES.register("gpipe")
def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
  """GPipe: every stage runs all M forwards, then all M backwards.

  Backwards run in reverse micro-batch order, so the last micro-batch, whose
  forward finished last, starts the drain. Each stage holds the activations
  of all M micro-batches at the turn.
  """
  m = num_microbatches
  return Schedule.of([[F(i) for i in range(m)]
                      + [B(i) for i in reversed(range(m))]
                      for _ in range(num_stages)])


@SCHEDULES.register("1f1b")
def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
  """1F1B (PipeDream-Flush): warm up, then alternate, then drain.

  Stage k first runs min(K-k-1, M) forwards (the warm-up that fills the
  pipeline below it), then alternates one forward and one backward, and
  finishes with the remaining backwards. Stage k so holds at most K-k
  micro-batches of activations, against M for GPipe, at the same bubble.
  """
  return Schedule.of(warmup_then_alternate(
      [min(num_stages - k - 1, num_microbatches) for k in range(num_stages)],
      num_microbatches))


def warmup_then_alternate(warmups: List[int],
                          num_microbatches: int) -> List[List[Action]]:
  """The 1F1B family: stage k runs `warmups[k]` forwards, then alternates
  one forward and one backward, then drains the remaining backwards. 1F1B
  and its variants differ only in the warm-up depths."""
  m = num_microbatches
  schedule = []
  for warmup in warmups:
    actions = [F(i) for i in range(warmup)]
    for j in range(m - warmup):
      actions += [F(warmup + j), B(j)]
    actions += [B(j) for j in range(m - warmup, m)]
    schedule.append(actions)
  return schedule

