r"""Compare finished runs: one table, one plot.

    python -m tools.compare runs/sync runs/async runs/pipeline \
        [--plot=compare.png] [--json=compare.json] [--logdir=runs/compare]

For each WORKDIR it reads `summary.json` (final metrics, throughput, and the
mode's own statistics such as staleness or bubble) and the TensorBoard event
files of its `tb/train` and `tb/eval` runs (the curves). It prints a
markdown table of the final numbers and writes a PNG with loss and accuracy
against step and against wall time (seconds since the run's first logged
point). With --logdir the same plot is also a TensorBoard image (tag
`compare/curves`, an RGB image at step 0, its description naming the runs),
so `tensorboard --logdir runs/` shows it in the Images tab beside the runs.

A run that diverged (exit code 3; summary.json's `diverged`) is marked
"(diverged)" in the table, with its reason on a line below it. A
summary.json that is not what a run writes, or an output that cannot be
written (a --plot or --json that is a directory or a FIFO, a --plot not
ending in .png, a missing directory, a --logdir that is not a directory),
is one `error:` line and exit code 1, before any output.

The terminal shows the tool's own lines only; `--verbosity=1` adds
TensorFlow's warnings, `--verbosity=2` everything
(`dist_loop/runtime/console.py`).
"""

import json
import os
import stat
import sys
from typing import Dict, List

from absl import app, flags

from dist_loop.runtime import console, files
from experiments import startup
from tools import goodput

FLAGS = flags.FLAGS
flags.DEFINE_string("plot", "compare.png", "Where the PNG plot goes ('' for "
                    "none).")
flags.DEFINE_string("json", "", "Optional: also write the table as JSON.")
flags.DEFINE_string("logdir", "", "Optional: also write the plot as a "
                    "TensorBoard image to this directory (a run of its own).")

CURVES = ("train/loss", "eval/loss", "train/accuracy", "eval/accuracy")
# Columns that every run has, then whatever mode-specific statistics exist.
BASE_COLUMNS = ("mode", "num_devices", "final_step", "train_loss",
                "eval_loss", "eval_accuracy", "examples_per_sec",
                "updates_per_sec", "wall_time_s")


class RunError(Exception):
  """A workdir that is not a finished run."""


def load_run(workdir: str) -> Dict:
  """summary.json and the scalar curves of one run.

  Raises:
    RunError: no summary.json, or one that is not what a run writes.
  """
  path = os.path.join(workdir, "summary.json")
  if os.path.exists(path) and not os.path.isfile(path):
    raise RunError(f"{path} is {goodput.file_kind(os.stat(path).st_mode)}, "
                   "not a run's summary; move it aside or leave that run out")
  if not os.path.isfile(path):
    raise RunError(f"{workdir} has no summary.json: is it a finished "
                   "dist_loop run?")
  summary = _read_summary(path)
  return {"name": os.path.basename(os.path.normpath(workdir)),
          "summary": summary,
          "curves": read_curves(os.path.join(workdir, "tb"))}


def _read_summary(path: str) -> Dict:
  """summary.json as a run writes it: an object whose base columns are
  numbers (or null), except `mode`."""
  fix = "rerun that run to rewrite it, or leave it out"
  try:
    with open(path, encoding="utf-8") as f:
      summary = json.load(f)
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise RunError(f"{path} is not readable JSON ({e}); {fix}") from None
  if not isinstance(summary, dict):
    raise RunError(f"{path} holds a JSON {type(summary).__name__}, not an "
                   f"object; {fix}")
  for column in BASE_COLUMNS[1:]:
    value = summary.get(column)
    if value is not None and (isinstance(value, bool)
                              or not isinstance(value, (int, float))):
      raise RunError(f"{path}: {column} is {value!r}, not a number; {fix}")
  return summary


def read_curves(logdir: str) -> Dict[str, List]:
  """{name: [(wall_time, step, value), ...]} for the names in CURVES.

  `train/loss` is tag `loss` of the run LOGDIR/train (`eval/...` of
  LOGDIR/eval); workdirs written before those runs existed keep the names
  as tags of LOGDIR itself.

  Raises:
    RunError: an event file that is not a regular file (reading a FIFO
      would block forever).
  """
  from tensorboard.backend.event_processing import event_accumulator as ea  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = {}
  for run, prefix in (("train", "train/"), ("eval", "eval/"), ("", "")):
    path = os.path.join(logdir, run)
    if not os.path.isdir(path):
      continue
    for name in os.listdir(path):
      if "tfevents" in name:
        _check_event_file(os.path.join(path, name))
    acc = ea.EventAccumulator(path, size_guidance={ea.TENSORS: 0})
    acc.Reload()
    for tag in acc.Tags().get("tensors", []):
      if prefix + tag in CURVES and prefix + tag not in out:
        out[prefix + tag] = [
            (e.wall_time, e.step, float(tf.make_ndarray(e.tensor_proto)))
            for e in acc.Tensors(tag)]
  return out


def _check_event_file(path: str) -> None:
  """Refuses an event file that is not a regular file, before TensorBoard's
  reader opens it. Raises RunError."""
  fix = "move it aside or leave that run out"
  try:
    mode = os.stat(path).st_mode
  except OSError as e:
    raise RunError(f"cannot read {path} ({e.strerror}); {fix}") from None
  if not stat.S_ISREG(mode):
    raise RunError(f"{path} is {goodput.file_kind(mode)}, not an event "
                   f"file; {fix}")


def table(runs: List[Dict]) -> str:
  extra = sorted({k for r in runs for k, v in r["summary"].items()
                  if k not in BASE_COLUMNS and isinstance(v, (int, float))})
  columns = ["run", *BASE_COLUMNS, *extra]

  def cell(v):
    if isinstance(v, float):
      return f"{v:.4g}"
    return "" if v is None else str(v)

  lines = ["| " + " | ".join(columns) + " |",
           "| " + " | ".join("---" for _ in columns) + " |"]
  for r in runs:
    marker = " (diverged)" if r["summary"].get("diverged") else ""
    values = {**r["summary"], "run": r["name"] + marker}
    lines.append("| " + " | ".join(cell(values.get(c)) for c in columns)
                 + " |")
  return "\n".join(lines)


def notes(runs: List[Dict]) -> List[str]:
  """A line per diverged run, with summary.json's reason (exit code 3)."""
  return [f"{r['name']} diverged: {r['summary']['diverged']}" for r in runs
          if r["summary"].get("diverged")]


def check_outputs(workdirs: List[str]) -> None:
  """Refuses an output that cannot be written, or that would replace a
  run's summary.json, before any work. Raises RunError."""
  for name, suffix in (("plot", ".png"), ("json", "")):
    path = FLAGS[name].value
    if not path:
      continue
    problem = goodput.output_problem(name, path, suffix)
    if problem:
      raise RunError(problem)
    for workdir in workdirs:
      summary = os.path.join(workdir, "summary.json")
      if (os.path.isfile(path) and os.path.isfile(summary)
          and os.path.samefile(path, summary)):
        raise RunError(f"--{name}={path} is {workdir}'s summary.json, which "
                       "it reads; choose another path")
  if FLAGS["logdir"].value:
    _check_logdir(FLAGS["logdir"].value)


def _check_logdir(logdir: str) -> None:
  """Refuses a --logdir that is not a writable directory, or one that
  cannot be made (TensorFlow makes the missing ones)."""
  named = f"--logdir={logdir}"
  existing = os.path.abspath(logdir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  mode = os.stat(existing).st_mode
  where = "" if existing == os.path.abspath(logdir) else f": {existing}"
  if not stat.S_ISDIR(mode):
    raise RunError(f"{named}{where} is {goodput.file_kind(mode)}, not a "
                   "directory; name a directory (a missing one is made)")
  if goodput.unwritable(existing):
    raise RunError(f"{named}: the directory {existing} is not writable "
                   f"({goodput.unwritable(existing)}); choose another path")


def figure(runs: List[Dict]):
  """Loss and accuracy against step (top) and wall time (bottom): train
  solid, eval dashed, one colour per run."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(2, 2, figsize=(11, 8), dpi=100)
  for col, metric in enumerate(("loss", "accuracy")):
    for row, x_axis in enumerate(("step", "wall time (s)")):
      ax = axes[row][col]
      for i, r in enumerate(runs):
        for split, style in (("train", "-"), ("eval", "--")):
          points = r["curves"].get(f"{split}/{metric}", [])
          if not points:
            continue
          t0 = min(p[0] for p in r["curves"].get("train/loss", points))
          xs = [p[1] if row == 0 else p[0] - t0 for p in points]
          ax.plot(xs, [p[2] for p in points], style, color=f"C{i}",
                  label=f"{r['name']} {split}")
      ax.set_xlabel(x_axis)
      ax.set_ylabel(metric)
      ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  return fig


def plot(runs: List[Dict], path: str) -> None:
  """The figure as a PNG file."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig = figure(runs)
  fig.savefig(path)
  plt.close(fig)


def image(runs: List[Dict]):
  """The figure as an HWC uint8 RGB array, as TensorBoard images are."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  fig = figure(runs)
  fig.canvas.draw()
  rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
  plt.close(fig)
  return rgb


def write_image(runs: List[Dict], logdir: str) -> None:
  """The figure as TensorBoard image `compare/curves` in `logdir`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  writer = tf.summary.create_file_writer(logdir)
  with writer.as_default(step=0):
    tf.summary.image(
        "compare/curves", image(runs)[None], max_outputs=1,
        description="Loss and accuracy against step (top) and wall time "
        "(bottom); train solid, eval dashed. Runs: "
        + ", ".join(r["name"] for r in runs))
  writer.close()


def verbosity() -> int:
  """--verbosity if given, else 0 (absl's default, -1, would also hide our
  info lines)."""
  flag = FLAGS["verbosity"]
  return 0 if flag.using_default_value else flag.value


def main(argv):
  workdirs = argv[1:]
  if not workdirs:
    raise app.UsageError("give one or more run workdirs")
  startup.start(verbosity())  # Imports TensorFlow, quietly.
  console.setup(verbosity())
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    check_outputs(workdirs)
    runs = [load_run(w) for w in workdirs]
  except RunError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(table(runs))
  for line in notes(runs):
    print(line)
  try:
    if FLAGS.plot:
      plot(runs, FLAGS.plot)
      print(f"plot: {FLAGS.plot}")
    if FLAGS.logdir:
      write_image(runs, FLAGS.logdir)
      print(f"tensorboard image compare/curves: {FLAGS.logdir}")
    if FLAGS.json:
      with open(FLAGS.json, "w") as f:
        json.dump([{"run": r["name"], **r["summary"]} for r in runs], f,
                  indent=2)
  except OSError as e:
    print(f"error: cannot write {e.filename or 'an output'}: "
          f"{e.strerror or e}", file=sys.stderr)
    return 1
  except tf.errors.OpError as e:  # The event file of --logdir.
    print(f"error: cannot write --logdir={FLAGS.logdir}: {files.reason(e)}",
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  app.run(main)
