"""Goodput in TensorBoard and summary.json: where the run's time went, over
every attempt on its workdir (`dist_loop/runtime/goodput.py` keeps the record)."""

from typing import Dict

from dist_loop.control.actions.base import Action
from dist_loop.runtime import goodput as goodput_lib


class Goodput(Action):
  """`goodput/goodput` and `goodput/<phase>_s` every `every` steps and at
  the end; summary.json's `goodput` and `goodput_<phase>_s` totals.

  Args:
    every: steps between the scalars (the log line's).
    recorder: the attempt's `goodput.Recorder`.
    summaries: `Summaries`.
  """

  at_end = True

  def __init__(self, every: int, recorder, summaries):
    self.every = every
    self._recorder = recorder
    self._summaries = summaries

  def __call__(self, step: int) -> None:
    totals = goodput_lib.totals(self._recorder.attempts())
    self._summaries.scalars(step, {
        f"goodput/{k}" if k == "goodput" else f"goodput/{k}_s": v
        for k, v in totals.items()
        if k not in ("attempts", "recomputed_steps")})

  def summary(self) -> Dict[str, float]:
    totals = goodput_lib.totals(self._recorder.attempts())
    out: Dict[str, float] = {"goodput": totals.pop("goodput")}
    out["goodput_attempts"] = totals.pop("attempts")
    out["goodput_recomputed_steps"] = totals.pop("recomputed_steps")
    out.update((f"goodput_{k}_s", v) for k, v in totals.items())
    return out
