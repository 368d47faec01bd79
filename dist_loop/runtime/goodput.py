"""Goodput: where a run's wall time goes, across every attempt on a workdir.

Goodput is the share of the wall time that moved the model forward: the
productive steps. Everything else is badput, in named phases:

- `import`, `join`, `build`, `trace`: start-up. `import` is the time from
  the process's start (Linux: /proc/self/stat) to `train.run`; `join` is
  joining the cluster; `build` is devices, data and the trainer; `trace` is
  what the first inner loop of an attempt took beyond its input waits and
  its steps at the steady pace (`Recorder.pace`): tracing, and with
  `--jit_compile` XLA's compilation, which runs when the traced loop first
  runs. The Goodput action prints the start-up once per attempt.
- `restore`: reading a checkpoint, at start and at each rollback.
- `recomputed`: steps trained again: those between the checkpoint an
  attempt restored and the furthest step an earlier attempt (or this one,
  before a rollback) reached. This is the work a crash lost.
- `input`: the time steps waited for their input, where the mode measures
  it (below; a trainer's `input_wait_s`); the steps' other time is
  `productive` or `recomputed`.
- `checkpoint`: the time a save blocked training (with
  `--async_checkpoint`, the copy to host and the wait for the previous
  save; at the end, the wait for the last one).
- `evaluation`: the `Evaluate` action.
- `other`: the rest of an attempt's wall time (log lines, summaries, the
  controller itself, and on several workers its SIGTERM agreement after
  every loop, a collective: `preemption.Agreement`).
- `downtime`: between attempts, from one attempt's last record to the next
  one's process start. A killed attempt's time after its last record is
  here too. Where `tools.launch` restarted the run, its record
  (`launch_record.py`) splits it into `downtime_unrecorded`, `_detect`,
  `_stop`, `_wait` and `_restart`; `downtime_other` is what no launcher
  restart explains (a rerun by hand, a scheduler's requeue).

**Input waits.** A mode on the loop base reads its input inside the traced
loop: the loop takes a timestamp before and after the iterator's `next`,
ordered by control dependencies, and adds the difference up; the
iterations of the loop run one after another, and the step's ops wait for
the second timestamp (with one inter-op thread, as on a worker pinned to
one core, that timestamp would otherwise run after them), so that is the
time the step waited for its batch (with tf.data's prefetch, a few
microseconds when the input keeps up). Under op determinism
(`--deterministic`), which refuses timestamps, it is not measured. The
async mode times each worker thread's `next_batch` on the host; a
worker's wait overlaps the other workers' steps, so a loop's `input` is
the workers' mean wait during it.
ps does not measure it (`input_wait_s` None, the phase 0): its batches
are read inside the functions the coordinator sends to the workers, and
only the workers see those waits (each function would have to return its
wait, per worker and call).

The record, WORKDIR/goodput.jsonl (goodput.worker-1.jsonl for another
process), is append-only JSON lines: each line is an attempt's cumulative
state after an inner loop, so the last line of an attempt is what it
reached, and a crash loses at most the inner loop it was in. A last line cut
short by a crash (no newline) is ignored; any other line that is not a
record makes the file corrupt (`read` raises). This module does not import
TensorFlow: `tools.goodput` reads the records cheaply.
"""

import json
import os
import time
from typing import Dict, List, Optional, Sequence

from absl import logging

from dist_loop.runtime import files, launch_record

GOODPUT_FILE = "goodput.jsonl"
STARTUP = ("import", "join", "build", "trace")
# Every phase of an attempt, in the order a table shows them; they sum to
# the attempt's wall time.
PHASES = (*STARTUP, "restore", "productive", "recomputed", "input",
          "checkpoint", "evaluation", "other")
# The parts of the downtime (`totals`): the launcher's, then the rest.
DOWNTIME = (*launch_record.PARTS, "other")
DOWNTIME_KEYS = tuple(f"downtime_{part}" for part in DOWNTIME)


class CorruptRecord(ValueError):
  """A line of a goodput record is not a record."""


def file_name(lock_name: str) -> str:
  """The record of the process holding `lock_name` (`workdir.lock_name`):
  `goodput.jsonl` for `lock`, `goodput.worker-1.jsonl` for `lock.worker-1`."""
  suffix = lock_name.partition(".")[2]
  return f"goodput.{suffix}.jsonl" if suffix else GOODPUT_FILE


def process_start_time() -> Optional[float]:
  """This process's start as a wall time, or None where /proc is missing."""
  try:
    with open("/proc/self/stat", encoding="ascii") as f:
      # The command may hold spaces: fields after its closing parenthesis.
      fields = f.read().rsplit(")", 1)[1].split()
    with open("/proc/uptime", encoding="ascii") as f:
      uptime = float(f.read().split()[0])
  except (OSError, IndexError, ValueError):
    return None
  age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
  return time.time() - max(age, 0.0)


_FIRST_RUN_IN_PROCESS = [True]


class Clock:
  """Start-up phases, measured before the record may be written (the
  workdir's write order): `import` from the process's start, then each
  `lap(phase)` since the previous one."""

  def __init__(self):
    now = time.time()
    started = process_start_time() if _FIRST_RUN_IN_PROCESS[0] else None
    _FIRST_RUN_IN_PROCESS[0] = False  # Later runs of a process import nothing.
    self.started = started if started is not None else now
    self.phases: Dict[str, float] = {"import": now - self.started}
    self._last = time.perf_counter()

  def lap(self, phase: str) -> None:
    now = time.perf_counter()
    self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
    self._last = now


class Recorder:
  """One attempt's phases, appended to its record after every inner loop.

  Args:
    path: the record file, or None to keep nothing (tests, tools).
    clock: the attempt's `Clock` (its start and start-up phases).
    meta: what the record keeps about the run (checkpoint interval, the
      expected failure interval), written on every line.
    launches: the launcher's record of the run (`launch_record.path`), read
      for the totals' downtime; None or missing: not launched.
  """

  def __init__(self, path: Optional[str], clock: Clock,
               meta: Optional[Dict[str, object]] = None,
               launches: Optional[str] = None):
    self.path = path
    self.launches = launches
    self.started = clock.started
    self.meta = dict(meta or {})
    self.phases = {phase: 0.0 for phase in PHASES}
    self.phases.update(clock.phases)
    self.steps = {"productive": 0, "recomputed": 0}
    self.saves = 0
    self.earlier = _earlier(path)
    self.furthest = max((a["furthest"] for a in self.earlier), default=0)
    self.restored: Optional[int] = None
    self.step = 0
    self.loops = 0
    # The first loop, split when the pace is known: [steps, seconds beyond
    # its input waits, recomputed steps].
    self._first: Optional[List[float]] = None

  def restore(self, step: Optional[int], seconds: float) -> None:
    """A restore (at start or a rollback) to `step` (None: nothing)."""
    self.phases["restore"] += seconds
    if self.restored is None:
      self.restored = step or 0
    self.step = step or 0

  def loop(self, start: int, end: int, seconds: float,
           input_s: float = 0.0) -> None:
    """An inner loop from `start` to `end` that took `seconds`, of which
    its steps waited `input_s` for their input; its steps up to the
    furthest step reached before are recomputed."""
    steps = end - start
    again = min(max(self.furthest - start, 0), steps)
    input_s = min(max(input_s, 0.0), seconds)
    self.phases["input"] += input_s
    seconds -= input_s
    if self._first is None:
      self._first = [steps, seconds, again]
    else:
      share = seconds * again / steps if steps else 0.0
      self.phases["recomputed"] += share
      self.phases["productive"] += seconds - share
      self.steps["recomputed"] += again
      self.steps["productive"] += steps - again
    self.furthest = max(self.furthest, end)
    self.step = end
    self.loops += 1
    self.write()

  def pace(self) -> Optional[float]:
    """Seconds per step at the steady pace, beyond input waits: this
    attempt's loops after its first, else (before its second loop) the
    earlier attempts'; None before any is known."""
    # This attempt's steps and phases hold no first loop's: they are the
    # steady state.
    for phases, steps in [(self.phases, self.steps),
                          *((a["phases"], a["steps"]) for a in
                            reversed(self.earlier))]:
      n = int(steps["productive"]) + int(steps["recomputed"])
      if n:
        return (phases["productive"] + phases["recomputed"]) / n
    return None

  def add(self, phase: str, seconds: float) -> None:
    self.phases[phase] = self.phases.get(phase, 0.0) + seconds
    if phase == "checkpoint":
      self.saves += 1

  def state(self, final: bool = False) -> Dict[str, object]:
    """This attempt's record line: the phases sum to its wall time."""
    now = time.time()
    phases = dict(self.phases)
    steps = dict(self.steps)
    if self._first is not None:
      n, seconds, again = self._first
      pace = self.pace() or 0.0
      work = min(seconds, n * pace)
      phases["trace"] += seconds - work
      share = work * again / n if n else 0.0
      phases["recomputed"] += share
      phases["productive"] += work - share
      steps["recomputed"] += again
      steps["productive"] += n - again
    known = sum(v for k, v in phases.items() if k != "other")
    phases["other"] = max(now - self.started - known, 0.0)
    return {"started": self.started, "t": now, "pid": os.getpid(),
            "step": self.step, "furthest": self.furthest,
            "restored": self.restored, "phases": phases, "steps": steps,
            "saves": self.saves, "final": final, **self.meta}

  def write(self, final: bool = False) -> None:
    """Appends this attempt's state: one write of one line, so a crash
    leaves at most a last line cut short."""
    if not self.path:
      return
    try:
      files.append_json_line(self.path, self.state(final))
    except OSError as e:  # A full disk: the run matters more than its record.
      logging.warning("Cannot append to %s (%s); this attempt's goodput is "
                      "no longer recorded.", self.path, e.strerror or e)
      self.path = None

  def attempts(self) -> List[Dict[str, object]]:
    """Every attempt of this process on the workdir, this one last."""
    return [*self.earlier, self.state()]

  def totals(self) -> Dict[str, float]:
    """`totals` over every attempt so far, with the launcher's record."""
    return totals(self.attempts(), self._launch_events())

  def _launch_events(self) -> List[Dict[str, object]]:
    """The launcher's record, read anew (a restart appends to it); none if
    there is none, and after a warning if it cannot be read."""
    if not self.launches or not os.path.exists(self.launches):
      return []
    try:
      return launch_record.read(self.launches)
    except (OSError, launch_record.CorruptRecord) as e:
      logging.warning("%s; the downtime is left unsplit.", e)
      self.launches = None
      return []

  def startup(self) -> Dict[str, float]:
    """This attempt's start-up, seconds by phase in the order they ran
    (`trace` as the loops so far split the first; `restore` with the
    rollbacks')."""
    phases = self.state()["phases"]
    return {p: phases[p] for p in ("import", "join", "build", "restore",
                                   "trace")}


def _earlier(path: Optional[str]) -> List[Dict[str, object]]:
  """The earlier attempts of a record; none if it is missing or corrupt (a
  warning: the run matters more than its record, which it appends to)."""
  if not path or not os.path.exists(path):
    return []
  try:
    return read(path)
  except (OSError, CorruptRecord) as e:
    logging.warning("%s; the goodput of earlier attempts is left out.", e)
    return []


def read(path: str) -> List[Dict[str, object]]:
  """The attempts of one record file, oldest first: each attempt's last
  line.

  Raises:
    OSError: the file cannot be read.
    CorruptRecord: a complete line that is not a record.
  """
  attempts: Dict[float, Dict[str, object]] = {}
  for number, line in files.complete_lines(path):
    try:
      record = json.loads(line.decode("utf-8"))
      key = float(record["started"]), int(record["pid"])
      float(record["t"])
      int(record["furthest"])
      record["phases"] = {str(k): float(v)
                          for k, v in record["phases"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise CorruptRecord(f"{path}, line {number}: not a goodput record "
                          f"({type(e).__name__})") from None
    for phase in PHASES:  # A record of an earlier version lacks `input`.
      record["phases"].setdefault(phase, 0.0)
    attempts[key] = record
  return sorted(attempts.values(), key=lambda a: a["started"])


def downtime(previous: Dict[str, object], attempt: Dict[str, object],
             events: Sequence[Dict[str, object]] = ()
             ) -> Optional[Dict[str, float]]:
  """The downtime between two attempts of one process, from `previous`'s
  last record to `attempt`'s process start, by part (`DOWNTIME`): the
  launcher's parts if its record `events` says it restarted `attempt`
  (None otherwise: all of it is `other`)."""
  end, started = float(previous["t"]), float(attempt["started"])
  parts = launch_record.split(events, end, started, int(attempt["pid"]))
  return None if parts is None else {**parts, "other": 0.0}


def totals(attempts: Sequence[Dict[str, object]],
           events: Sequence[Dict[str, object]] = ()) -> Dict[str, float]:
  """Seconds per phase over `attempts` (oldest first), with `downtime`
  between them, and `wall`, `goodput` (productive / wall), `attempts`,
  `recomputed_steps`. If the launcher's record `events` restarted any
  attempt, also the downtime's parts, `downtime_<part>` (`DOWNTIME`)."""
  out = {phase: 0.0 for phase in PHASES}
  gaps = dict.fromkeys(DOWNTIME, 0.0)
  launched = False
  for previous, attempt in zip([None, *attempts], attempts):
    for phase, seconds in attempt["phases"].items():
      out[phase] = out.get(phase, 0.0) + float(seconds)
    if previous is not None:
      parts = downtime(previous, attempt, events)
      launched = launched or parts is not None
      if parts is None:
        parts = {"other": max(float(attempt["started"])
                              - float(previous["t"]), 0.0)}
      for part, seconds in parts.items():
        gaps[part] += seconds
  out["downtime"] = sum(gaps.values())
  if launched:
    out.update((f"downtime_{part}", s) for part, s in gaps.items())
  out["wall"] = sum(out[p] for p in out if p not in DOWNTIME_KEYS)
  out["goodput"] = out["productive"] / out["wall"] if out["wall"] > 0 else 0.0
  out["attempts"] = len(attempts)
  out["recomputed_steps"] = sum(int(a["steps"]["recomputed"])
                                for a in attempts)
  return out


def optimal_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
  """Young/Daly: the checkpoint interval (seconds) that maximises goodput
  for a save that blocks `checkpoint_cost_s` and a failure every `mtbf_s`
  on average: sqrt(2 * cost * MTBF)."""
  return (2.0 * checkpoint_cost_s * mtbf_s) ** 0.5


def interval_waste(interval_s: float, checkpoint_cost_s: float,
                   mtbf_s: float) -> float:
  """The share of the time an interval costs (first-order Young model):
  saving, `cost / interval`, plus the work a failure loses, on average half
  an interval, `interval / (2 * MTBF)`."""
  return checkpoint_cost_s / interval_s + interval_s / (2.0 * mtbf_s)
