"""The launcher's record: what `tools.launch` did between a run's attempts.

`tools.launch` appends one JSON line per event to WORKDIR/logs/launch.jsonl
(LOG_DIR/launch.jsonl with `--log_dir`). Every event has `event` and `t`,
a wall time (`time.time()`):

- `start`: the launcher starts the cluster (`restart` 0) or starts it
  again (`restart` k); `tasks` is {task: pid}, and `t` is before the
  first task starts.
- `failed`: it saw a task fail: `task`, `code` (-N: killed by signal N),
  `t` the task's exit, `detected` when the launcher saw it, `tolerated`
  (a ps-mode worker, which is no reason to restart).
- `stopped`: the other tasks have ended (SIGTERM, then SIGKILL after a
  grace).
- `waited`: the cluster's ports are free again (`ports_free` false: it
  gave up, and takes new ones).
- `exit`: the launcher ends with `code`.
- `fork_server`: it started the fork server its tasks are forked from
  (`tools/fork_server.py`) at `t`, with `pid`, ready (its `preload`
  imported) at `ready`; or it could not, and `error` says why. Before the
  first `start`, and before a `start` whose server had died.

A line is one write (`files.append_json_line`), so a crash leaves at most a
last line cut short, which `read` leaves out; any other line that is not
an event makes the file corrupt. The launcher never fails over its record:
a failed write is one warning, and recording stops.

`split` reads it to say what the downtime before an attempt that the
launcher restarted was (an attempt is the launcher's if its PID is in the
tasks of a `start` before the attempt's start): the time from the
previous attempt's last goodput record to the attempt's process start, in
the parts of `PARTS`:

- `unrecorded`: the previous attempt's time after its last record, to the
  failure (the inner loop it died in, or a hang);
- `detect`: from the failure to the launcher's noticing it (it polls);
- `stop`: stopping the other tasks;
- `wait`: waiting for the cluster's ports to free;
- `restart`: from then to this process's start (the launcher starting
  the tasks).

Starting again is mostly the new attempt's own start-up (`import`, `join`,
`build`, `trace`), which its goodput record holds. This module does not
import TensorFlow.
"""

import json
import os
from typing import Dict, List, Optional, Sequence

from dist_loop.runtime import files

FILE_NAME = "launch.jsonl"
LOG_DIR = "logs"  # The launcher's default log directory in a workdir.
PARTS = ("unrecorded", "detect", "stop", "wait", "restart")
# A process's start time (goodput.process_start_time) is estimated from
# /proc in clock ticks: it may read a little before the launcher's `t`.
_START_SLACK_S = 1.0


class CorruptRecord(ValueError):
  """A line of the launcher's record is not an event."""


def path(workdir: str) -> str:
  """Where `tools.launch` keeps the record of a run in `workdir`."""
  return os.path.join(workdir, LOG_DIR, FILE_NAME)


def read(record_path: str) -> List[Dict[str, object]]:
  """The events of a record, in the order they were written.

  Raises:
    OSError: the file cannot be read.
    CorruptRecord: a complete line that is not an event.
  """
  events = []
  for number, line in files.complete_lines(record_path):
    try:
      event = json.loads(line.decode("utf-8"))
      str(event["event"])
      event["t"] = float(event["t"])
      if event["event"] == "start":
        event["tasks"] = {str(k): int(v) for k, v in event["tasks"].items()}
      if event["event"] == "failed":
        event["detected"] = float(event["detected"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise CorruptRecord(f"{record_path}, line {number}: not a launcher "
                          f"event ({type(e).__name__})") from None
    events.append(event)
  return events


def read_if_any(record_path: Optional[str]) -> List[Dict[str, object]]:
  """`read`, or no events if the file is missing, unreadable or corrupt
  (a benchmark's totals: the downtime then stays unsplit)."""
  if not record_path or not os.path.exists(record_path):
    return []
  try:
    return read(record_path)
  except (OSError, CorruptRecord):
    return []


def split(events: Sequence[Dict[str, object]], end: float, started: float,
          pid: int) -> Optional[Dict[str, float]]:
  """The downtime from `end` (an attempt's last record) to `started` (the
  next attempt's process start; its pid `pid`), in `PARTS`, which add up
  to `max(started - end, 0)`; None unless the launcher of `events` started
  that process in a restart."""
  restart = _restart(events, started, pid)
  if restart is None:
    return None
  failed, stopped, waited = (restart.get(k) for k in ("failed", "stopped",
                                                       "waited"))
  ends = [failed and failed["t"], failed and failed["detected"],
          stopped and stopped["t"], waited and waited["t"]]
  # Each part ends where the next begins, within [end, started]; a mark the
  # record lacks gives its part nothing.
  high = max(started, end)
  out, low = {}, end
  for part, mark in zip(PARTS, [*ends, high]):
    mark = low if mark is None else min(max(float(mark), low), high)
    out[part] = mark - low
    low = mark
  return out


def failure(events: Sequence[Dict[str, object]], started: float,
            pid: int) -> Optional[str]:
  """What the launcher restarted the process `pid` (started at `started`)
  after: "worker:1, exit code 1" or "..., killed by signal 9"; None if it
  did not restart it, or the record names no failure."""
  failed = (_restart(events, started, pid) or {}).get("failed")
  if failed is None:
    return None
  code = int(failed["code"])
  how = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
  return f"{failed['task']}, {how}"


def _restart(events, started: float, pid: int
             ) -> Optional[Dict[str, Dict[str, object]]]:
  """The events of the restart that started process `pid` ({kind: the
  first such event since the previous start}, with `start`), or None if no
  restart of the record started it."""
  index = None
  for i, event in enumerate(events):
    if (event["event"] == "start" and pid in event["tasks"].values()
        and event["t"] <= started + _START_SLACK_S):
      index = i  # The last start naming it: pids are reused.
  if index is None or not events[index].get("restart"):
    return None
  previous = max((i for i in range(index) if events[i]["event"] == "start"),
                 default=-1)
  out = {"start": events[index]}
  for event in events[previous + 1:index]:
    if not event.get("tolerated"):
      out.setdefault(str(event["event"]), event)
  return out
