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
corrupt record (goodput's or the launcher's) is one line and exit code 2.
"""

import os
import sys
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
                     lower_bound=0.0)

COLUMNS = (*goodput.PHASES, "downtime")
RESTART_COLUMNS = (*launch_record.PARTS, "downtime")


class BadInput(Exception):
  """A workdir this tool cannot read."""


def load(workdir: str) -> Dict[str, List[Dict]]:
  """{process record name: its attempts, oldest first}."""
  if not os.path.isdir(workdir):
    raise BadInput(f"{workdir} is not a directory; give a run's --workdir")
  names = sorted(n for n in os.listdir(workdir)
                 if n.startswith("goodput.") and n.endswith(".jsonl"))
  records = {}
  for name in names:
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
    plot(runs, FLAGS.plot)
    print(f"plot: {FLAGS.plot}")
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
