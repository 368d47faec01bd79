r"""Where a run's time went, over every attempt: one table per run, a plot.

    python -m tools.goodput runs/a [runs/b ...] [--plot=goodput.png] \
        [--expected_failure_interval_s=3600]

For each WORKDIR it reads the goodput records its processes appended
(`goodput.jsonl`, `goodput.worker-1.jsonl`, ...; `dist_loop/runtime/goodput.py`
says what each phase is) and prints a markdown table: one row per attempt
of each process (seconds per phase, the downtime before it, its goodput)
and the run's total. If `tools.launch` restarted the run, its record
(WORKDIR/logs/launch.jsonl, `dist_loop/runtime/launch_record.py`) gives a
second table: for each attempt it restarted, the failure and what the
downtime before the attempt was (the failed attempt's time after its last
record, detecting the failure, stopping the other tasks, waiting for the
ports, starting again). Below them, Young/Daly: from the measured blocking time
of a save and the mean time between failures (the flag, else the run's
`--expected_failure_interval_s`, else the failures its records show) the
checkpoint interval that maximises goodput, sqrt(2 x cost x MTBF), and what
the run's own interval costs against it. The PNG shows each attempt's time
by phase, across all runs. A missing workdir, one without records, or a
corrupt record (goodput's or the launcher's), a record that is not a
regular file (a FIFO would block the read forever), or a --plot that cannot
be written (a directory, a name not ending in .png, a missing directory) is
one line and exit code 2, the --plot checked before anything is read.
"""

import math
import os
import stat
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

from absl import app, flags

from dist_loop.runtime import goodput, launch_record

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The tool's flags, defined only when it runs: `--expected_failure_
  interval_s` is also a run's flag, in a process that imports both."""
  flags.DEFINE_string("plot", "goodput.png", "Where the PNG plot goes ('' "
                      "for none).")
  flags.DEFINE_float("expected_failure_interval_s", 0.0, "Mean seconds "
                     "between failures for the best interval; 0: the run's "
                     "own flag, else the failures its records show.",
                     lower_bound=0.0, upper_bound=1e9)  # As the run's flag.
  flags.register_validator(
      "expected_failure_interval_s", math.isfinite,
      "must be a number of seconds (0: the run's own flag), not nan")

COLUMNS = (*goodput.PHASES, "downtime")
RESTART_COLUMNS = (*launch_record.PARTS, "downtime")


_KINDS = ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISFIFO, "a FIFO (pipe)"),
          (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class BadInput(Exception):
  """A workdir this tool cannot read."""


def file_kind(mode: int) -> str:
  """What a file of `os.stat` mode `mode` is: "a FIFO (pipe)", ..."""
  return next((what for test, what in _KINDS if test(mode)), "a special file")


def output_problem(flag: str, path: str, suffix: str = "") -> Optional[str]:
  """Why `--flag=path` cannot be written, or None; checked before any work,
  and before the path is opened (opening a FIFO blocks). Also tools.compare's.

  Args:
    flag: the flag's name, for the message.
    path: a new file or a regular file to replace, in an existing, writable
      directory.
    suffix: the ending the name needs, if any (".png": matplotlib would add
      it to a name without one, and write another file than the one named).
  """
  named = f"--{flag}={path}"
  if os.path.exists(path):
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
      return f"{named} is {file_kind(mode)}; name a file"
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(directory):
    if os.path.exists(directory):
      return (f"{named}: {directory} is {file_kind(os.stat(directory).st_mode)}"
              ", not a directory; choose another path")
    return (f"{named}: the directory {directory} does not exist; create it or "
            "choose another path")
  if unwritable(directory):
    return (f"{named}: the directory {directory} is not writable "
            f"({unwritable(directory)}); choose another path")
  if suffix and not path.lower().endswith(suffix):
    return f"{named} does not end in {suffix}; name a {suffix} file"
  return None


def unwritable(directory: str) -> str:
  """Why no file can be made in `directory`, or "": tried with a nameless
  temporary file (`os.access` says yes to root, and on /proc)."""
  try:
    with tempfile.TemporaryFile(dir=directory):
      return ""
  except OSError as e:
    return e.strerror or str(e)


def _check_record(path: str, fix: str) -> None:
  """Refuses a record that is not a regular file, before it is opened: a
  FIFO would block the read forever, a device never end it."""
  try:
    mode = os.stat(path).st_mode
  except OSError as e:
    raise BadInput(f"cannot read {path} ({e.strerror})") from None
  if not stat.S_ISREG(mode):
    raise BadInput(f"{path} is {file_kind(mode)}, not a record; {fix}")


def load(workdir: str) -> Dict[str, List[Dict]]:
  """{process record name: its attempts, oldest first}."""
  if not os.path.isdir(workdir):
    raise BadInput(f"{workdir} is not a directory; give a run's --workdir")
  names = sorted(n for n in os.listdir(workdir)
                 if n.startswith("goodput.") and n.endswith(".jsonl"))
  records = {}
  for name in names:
    _check_record(os.path.join(workdir, name),
                  "move it aside to read the others")
    try:
      attempts = goodput.read(os.path.join(workdir, name))
    except goodput.CorruptRecord as e:
      raise BadInput(f"{e}; move the file aside to read the others") from None
    except OSError as e:
      raise BadInput(f"cannot read {os.path.join(workdir, name)} "
                     f"({e.strerror})") from None
    if attempts:
      records[name] = attempts
  if not records:
    raise BadInput(f"{workdir} holds no goodput record (goodput.jsonl); is "
                   "it the workdir of a run of this version?")
  return records


def load_launches(workdir: str) -> List[Dict]:
  """The launcher's events for `workdir`; none if it was not launched."""
  path = launch_record.path(workdir)
  if not os.path.exists(path):
    return []
  _check_record(path, "move it aside to read the goodput records without it")
  try:
    return launch_record.read(path)
  except launch_record.CorruptRecord as e:
    raise BadInput(f"{e}; move the file aside to read the goodput records "
                   "without it") from None
  except OSError as e:
    raise BadInput(f"cannot read {path} ({e.strerror})") from None


def rows(records: Dict[str, List[Dict]], launches: Sequence[Dict] = ()
         ) -> List[Dict[str, object]]:
  """One row per attempt of each process, then the total of the chief's
  (or the first process's) attempts. A row the launcher restarted has
  `failure` and its downtime's parts (`launch_record.PARTS`)."""
  out = []
  for name, attempts in records.items():
    process = name[len("goodput."):-len(".jsonl")] or "chief"
    previous = None
    for number, attempt in enumerate(attempts, 1):
      row = {"attempt": f"{process} {number}", **attempt["phases"]}
      row["downtime"] = 0.0
      if previous is not None:
        parts = goodput.downtime(previous, attempt, launches)
        row["downtime"] = (sum(parts.values()) if parts is not None else max(
            attempt["started"] - previous["t"], 0.0))
        if parts is not None:
          row.update(parts)
          row["failure"] = launch_record.failure(
              launches, attempt["started"], attempt["pid"]) or "-"
      wall = sum(row[c] for c in COLUMNS)
      row["goodput"] = row["productive"] / wall if wall else 0.0
      row["steps"] = f"{attempt['restored']}->{attempt['step']}"
      out.append(row)
      previous = attempt
  main = records.get(goodput.GOODPUT_FILE) or next(iter(records.values()))
  totals = goodput.totals(main, launches)
  out.append({"attempt": "total", **{c: totals[c] for c in COLUMNS},
              "goodput": totals["goodput"],
              "steps": f"{totals['recomputed_steps']} recomputed"})
  return out


def table(name: str, table_rows: List[Dict[str, object]]) -> str:
  head = ["attempt", "steps", *COLUMNS, "goodput"]
  lines = [f"## {name} (seconds)", "",
           "| " + " | ".join(head) + " |",
           "|" + "---|" * len(head)]
  for row in table_rows:
    cells = [row["attempt"], row["steps"],
             *(f"{row[c]:.2f}" for c in COLUMNS), f"{row['goodput']:.3f}"]
    lines.append("| " + " | ".join(str(c) for c in cells) + " |")
  return "\n".join(lines)


def restarts_table(table_rows: List[Dict[str, object]]) -> Optional[str]:
  """The downtime before each attempt the launcher restarted, by part;
  None if it restarted none."""
  restarted = [row for row in table_rows if "failure" in row]
  if not restarted:
    return None
  head = ["attempt", "after", *RESTART_COLUMNS]
  lines = ["restarts by tools.launch (seconds of downtime; "
           "logs/launch.jsonl):", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for row in restarted:
    cells = [row["attempt"], row["failure"],
             *(f"{row[c]:.2f}" for c in RESTART_COLUMNS)]
    lines.append("| " + " | ".join(str(c) for c in cells) + " |")
  return "\n".join(lines)


def young_daly(attempts: List[Dict], given: float) -> str:
  """The best checkpoint interval and what the run's own costs."""
  totals = goodput.totals(attempts)  # The downtime's parts are not needed.
  saves = sum(int(a["saves"]) for a in attempts)
  steps = sum(int(a["steps"]["productive"]) + int(a["steps"]["recomputed"])
              for a in attempts)
  if not saves or not steps:
    return "Young/Daly: no save or no step recorded yet."
  cost = totals["checkpoint"] / saves
  pace = (totals["productive"] + totals["recomputed"]) / steps
  failures = sum(1 for a in attempts if not a["final"])
  recorded = float(attempts[-1].get("expected_failure_interval_s") or 0.0)
  if given or recorded:
    mtbf, source = given or recorded, "given"
  elif failures:
    mtbf, source = totals["wall"] / failures, f"{failures} failures observed"
  else:
    return (f"Young/Daly: a save blocks {cost:.3f} s; no failure observed: "
            "pass --expected_failure_interval_s for the best interval.")
  best = goodput.optimal_interval_s(cost, mtbf)
  own = int(attempts[-1].get("checkpoint_every") or 0) * pace
  text = (f"Young/Daly: a save blocks {cost:.3f} s, a step takes "
          f"{pace:.4f} s, MTBF {mtbf:.0f} s ({source}): the best interval is "
          f"{best:.1f} s (--checkpoint_every={max(round(best / pace), 1)}), "
          f"losing {goodput.interval_waste(best, cost, mtbf):.2%} of the time")
  if own:
    text += (f"; the run's {own:.1f} s (--checkpoint_every="
             f"{attempts[-1]['checkpoint_every']}) loses "
             f"{goodput.interval_waste(own, cost, mtbf):.2%}")
  return text + "."


def plot(runs: Dict[str, List[Dict[str, object]]], path: str) -> None:
  """Stacked bars: each attempt's seconds by phase, after the downtime
  before it, every run's attempts."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  labels, bars = [], []
  for name, table_rows in runs.items():
    for row in table_rows:
      if row["attempt"] != "total":
        labels.append(f"{name}: {row['attempt']}")
        bars.append(row)
  fig, ax = plt.subplots(figsize=(10, 1.0 + 0.4 * len(bars)))
  left = [0.0] * len(bars)
  # First the downtime before the attempt, by the launcher's parts where
  # it restarted the attempt.
  segments = [*launch_record.PARTS, "downtime", *goodput.PHASES]
  for segment in segments:
    widths = [_width(row, segment) for row in bars]
    if not any(widths):
      continue
    label = (f"downtime: {segment}" if segment in launch_record.PARTS
             else segment)
    ax.barh(labels, widths, left=left, label=label)
    left = [a + b for a, b in zip(left, widths)]
  ax.invert_yaxis()
  ax.set_xlabel("seconds")
  ax.set_title("where the time went, per attempt")
  ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _width(row: Dict[str, object], segment: str) -> float:
  """A row's seconds in one segment of its bar."""
  if segment == "downtime":  # What the launcher's parts do not hold.
    return 0.0 if "failure" in row else float(row["downtime"])
  return float(row.get(segment, 0.0))


def main(argv) -> Optional[int]:
  workdirs = argv[1:]
  if not workdirs:
    print("error: give one or more run workdirs: python -m tools.goodput "
          "WORKDIR", file=sys.stderr)
    return 2
  problem = FLAGS.plot and output_problem("plot", FLAGS.plot, ".png")
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  try:
    loaded = {w: (load(w), load_launches(w)) for w in workdirs}
  except BadInput as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  runs = {}
  for workdir, (records, launches) in loaded.items():
    name = os.path.basename(os.path.normpath(workdir))
    runs[name] = rows(records, launches)
    print(table(name, runs[name]))
    restarts = restarts_table(runs[name])
    if restarts:
      print()
      print(restarts)
    main_attempts = (records.get(goodput.GOODPUT_FILE)
                     or next(iter(records.values())))
    print()
    print(young_daly(main_attempts, FLAGS.expected_failure_interval_s))
    print()
  if FLAGS.plot:
    try:
      plot(runs, FLAGS.plot)
    except OSError as e:  # Checked first; the directory may still refuse it.
      print(f"error: cannot write {FLAGS.plot}: {e.strerror or e}",
            file=sys.stderr)
      return 2
    print(f"plot: {FLAGS.plot}")
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
