"""What an action is, and what it is told about each inner loop.

An action runs after the inner loop that reaches each multiple of its
`every` (and, if `at_end`, at the last step), called with the step. What it
produces goes where it belongs (TensorBoard, the terminal, a checkpoint,
summary.json), not back to the controller. The controller stops each inner loop
at the next step any action asks for (`stops`), so events land on exact
steps. After every inner loop each action also sees what happened in it
(`observe`), so the log line can average the metrics since the last one.
"""

import dataclasses
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True)
class Loop:
  """One inner loop, as the controller saw it.

  `metrics` are `train(n)`'s means over the loop's applied updates (no task
  metric when none was applied). `skipped` counts the steps that advanced
  the counter without applying their update; `skipped_at_end` those after
  the loop's last applied update (all of `skipped` if none was applied).
  """

  start: int
  end: int
  metrics: Mapping[str, float]
  skipped: int
  examples: int
  seconds: float
  skipped_at_end: int = 0

  @property
  def steps(self) -> int:
    return self.end - self.start

  @property
  def updates(self) -> int:
    """Applied updates: the definition of every `updates_per_sec`, and the
    weight of the loop's metrics in any mean over several loops."""
    return self.steps - self.skipped


class Action:
  """Something the controller does at steps of its schedule.

  Attributes:
    every: runs after the loop that reaches each multiple of it (0: never
      by this rule).
    at_end: also runs at the last step, and once at the end of a run that
      had nothing to train.
    phase: the goodput phase its time counts to
    (`dist_loop/runtime/goodput.py`).
  """

  every: int = 0
  at_end: bool = False
  phase: str = "other"

  def stops(self, step: int) -> Optional[int]:
    """The next step after `step` where the inner loop must stop for this
    action, or None."""
    return (step // self.every + 1) * self.every if self.every else None

  def due(self, step: int) -> bool:
    """Whether to run after the loop that reached `step`."""
    return bool(self.every) and step % self.every == 0

  def start(self, step: int) -> None:
    """Before the first inner loop of the run, at `step`."""

  def observe(self, loop: Loop) -> None:
    """After every inner loop, before any action runs."""

  def interrupted(self, step: int) -> None:
    """The run stops early at `step` (SIGTERM or Ctrl-C), before `step`'s
    scheduled actions ran or after some of them did."""

  def __call__(self, step: int) -> None:
    raise NotImplementedError
