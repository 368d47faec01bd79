"""When a run that finished counts as diverged, so it is not reported as a
success.

A run is *diverged* if its last logged train loss is more than `ratio`
(`--diverged_loss_ratio`, default 10; 0 turns this test off) times the loss
of its first step, or if its final evaluation has a non-finite value (always
checked). Such a run still saves its checkpoint and writes summary.json, with
`"diverged": "<reason>"` (null for a healthy run); then `train.run` raises
`DivergedError`, whose exit code is 3, so a script or a launcher that checks
the exit code does not take garbage for a result.

Why the first step and not the first log line: a run unstable from the
start blows up within its first window (the `Log` action's docstring). A
resumed run compares with the first loss its workdir's summary.json
recorded (a rerun of a diverged run stays diverged), else with its own
first step after the resume.

`--max_loss` is the other guard: it stops a run at the first step above a
fixed loss; this verdict is about runs that reach their last step.
"""

import math
from typing import Dict, Mapping, Optional


def reason(first_loss: Optional[float], last_loss: Optional[float],
           evaluation: Optional[Mapping[str, float]],
           ratio: float) -> Optional[str]:
  """Why the run diverged, or None if it did not.

  Args:
    first_loss: the train loss of the run's first step (None: unknown).
    last_loss: its last logged train loss (None: no update was applied).
    evaluation: the final evaluation (`eval/<name>` -> value), or None.
    ratio: the bound on last / first; 0 turns that test off.
  """
  for name, value in sorted((evaluation or {}).items()):
    if not math.isfinite(value):
      return f"the final {name} is {value}"
  if not ratio or first_loss is None or last_loss is None:
    return None
  if not math.isfinite(last_loss):
    return f"the last logged train loss is {last_loss}"
  if first_loss > 0 and last_loss > ratio * first_loss:
    return (f"the last logged train loss, {last_loss:.4g}, is "
            f"{last_loss / first_loss:.3g} times the first step's "
            f"{first_loss:.4g} (--diverged_loss_ratio={ratio:g})")
  return None


def message(why: str, step: int) -> str:
  """The one line a diverged run ends with."""
  return (f"the run diverged: {why}. Its checkpoint of step {step} and "
          "summary.json were saved. Lower --learning_rate (--max_loss=L "
          "stops a run at its first step with a loss above L)")


class Verdict:
  """summary.json's `diverged` entry, from the `Log` action's first and last
  loss and the `Evaluate` action's final evaluation."""

  def __init__(self, log, evaluate, ratio: float):
    self._log = log
    self._evaluate = evaluate
    self._ratio = ratio

  def summary(self) -> Dict[str, Optional[str]]:
    return {"diverged": reason(self._log.first_loss, self._log.last_loss,
                               self._evaluate.last, self._ratio)}
