"""Goodput in TensorBoard, summary.json and the terminal: where the run's
time went, over every attempt on its workdir (`dist_loop/runtime/goodput.py`
keeps the record; the launcher's record splits the downtime)."""

from typing import Dict

from absl import logging

from dist_loop.control.actions.base import Action, Loop


class Goodput(Action):
  """`goodput/goodput` and `goodput/<phase>_s` every `every` steps and at
  the end; summary.json's `goodput` and `goodput_<phase>_s` totals; and
  once per attempt the start-up line, which says what tracing (and XLA's
  compilation) took.

  The start-up line comes once the steady pace is known, which tells the
  first loop's tracing from its steps: after the attempt's first inner
  loop if an earlier attempt trained, else after its second (or at the
  end, if there was one loop).

  Args:
    every: steps between the scalars (the log line's).
    recorder: the attempt's `goodput.Recorder`.
    summaries: `Summaries`.
    compiles: `--jit_compile`: the first loop also compiles with XLA.
  """

  at_end = True

  def __init__(self, every: int, recorder, summaries, compiles=False):
    self.every = every
    self._recorder = recorder
    self._summaries = summaries
    self._compiles = compiles
    self._said = False

  def observe(self, loop: Loop) -> None:
    del loop
    if self._recorder.loops and self._recorder.pace() is not None:
      self._say_startup()

  def __call__(self, step: int) -> None:
    totals = self._recorder.totals()
    self._summaries.scalars(step, {
        f"goodput/{k}" if k == "goodput" else f"goodput/{k}_s": v
        for k, v in totals.items()
        if k not in ("attempts", "recomputed_steps")})

  def summary(self) -> Dict[str, float]:
    if self._recorder.loops:
      self._say_startup()
    totals = self._recorder.totals()
    out: Dict[str, float] = {"goodput": totals.pop("goodput")}
    out["goodput_attempts"] = totals.pop("attempts")
    out["goodput_recomputed_steps"] = totals.pop("recomputed_steps")
    out.update((f"goodput_{k}_s", v) for k, v in totals.items())
    return out

  def _say_startup(self) -> None:
    if self._said:
      return
    self._said = True
    logging.info("%s", startup_line(self._recorder.startup(),
                                    self._compiles))


def startup_line(phases: Dict[str, float], compiles: bool) -> str:
  """`start-up 9.1 s: import 3.2 s, ..., trace 2.5 s (...)`."""
  what = "tracing and XLA compilation" if compiles else "tracing"
  parts = ", ".join(f"{p} {phases[p]:.1f} s" for p in phases)
  return (f"start-up {sum(phases.values()):.1f} s: {parts} (trace: the "
          f"first inner loop's {what})")
