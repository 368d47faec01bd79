"""summary.json: the outcome of a run, written at its end.

Its entries come from parts, each a callable that returns some: the `Log`
action's train values, the `Evaluate` action's, the non-finite policy's
rollbacks, the mode's `Reporting.summary()`, the divergence verdict, peak
memory. Nothing here is named for a task: a classifier's summary has
`eval_accuracy`, a language model's `eval_bits_per_byte`.

The action itself owns what it alone reports, the run's totals:
`examples_per_sec` and `updates_per_sec` over the steady state (every inner
loop but the first, which traces; all of them if there was only one), the
skipped steps and the wall time.
"""

import time
from typing import Callable, Dict, Mapping, Optional, Sequence

from dist_loop.control.actions.base import Action, Loop
from dist_loop.core.errors import UserError
from dist_loop.runtime.files import atomic_write_json

Part = Callable[[], Mapping[str, object]]


class Summary(Action):
  """Builds the summary at the end; on the chief, writes it.

  Args:
    path: where to write summary.json, or None (not the chief).
    summaries: `Summaries` (`final()`: the rates as TensorBoard scalars).
    parts: entries from elsewhere, merged in order (later ones win).
    newest_checkpoint: returns the step of the newest saved checkpoint, or
      None: named when summary.json cannot be written.
  """

  at_end = True

  def __init__(self, path: Optional[str], summaries, parts: Sequence[Part],
               newest_checkpoint: Callable[[], Optional[int]]):
    self._path = path
    self._summaries = summaries
    self._parts = list(parts)
    self._newest_checkpoint = newest_checkpoint
    self._started = time.time()
    # [examples, updates, seconds] over every loop, and over all but the
    # first.
    self._all = [0, 0, 0.0]
    self._steady = [0, 0, 0.0]
    self._loops = 0
    self._skipped = 0
    self.written: Optional[Dict[str, object]] = None  # What it wrote.

  def observe(self, loop: Loop) -> None:
    for totals in (self._all, self._steady) if self._loops else (self._all,):
      totals[0] += loop.examples
      totals[1] += loop.updates
      totals[2] += loop.seconds
    self._loops += 1
    self._skipped += loop.skipped

  def __call__(self, step: int) -> None:
    examples, updates, seconds = (self._steady if self._loops > 1
                                  else self._all)
    seconds = max(seconds, 1e-9)
    summary: Dict[str, object] = {
        "final_step": step,
        "examples_per_sec": examples / seconds,
        "updates_per_sec": updates / seconds,
        "wall_time_s": time.time() - self._started,
        "skipped_steps": self._skipped,
    }
    for part in self._parts:
      summary.update(part())
    if self._path:
      self._write(summary)
    self._summaries.final(summary)
    self._summaries.flush()
    self.written = summary

  def _write(self, summary: Mapping[str, object]) -> None:
    try:
      atomic_write_json(self._path, summary)
    except OSError as e:
      newest = self._newest_checkpoint()
      saved = ("no checkpoint was saved" if newest is None else
               f"its newest checkpoint, of step {newest}, is saved")
      raise UserError(
          f"cannot write {self._path} ({e.strerror or e}); the run is "
          f"complete and {saved}. Make room for it and rerun the same "
          "command to write it") from None
