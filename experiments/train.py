r"""Trains a model with a hand-written distributed loop.

    python -m experiments.train --flagfile=experiments/configs/default.flags \
        --workdir=runs/default

Rerunning the same command resumes from the workdir's latest checkpoint.
`--helpfull` lists every flag, with each mode's, model's and dataset's own
options under its name. The terminal shows the run's own lines only;
`--verbosity=1` adds TensorFlow's warnings, `--verbosity=2` everything
(`dist_loop/console.py`).
"""

import sys

from absl import flags

from dist_loop import console


def requested_verbosity(argv) -> int:
  """`--verbosity` (or `-v`) from a command line and its flagfiles, read
  before the flags below exist; 0 if absent or unreadable (the real parse
  reports the error)."""
  values = flags.FlagValues()
  flags.DEFINE_integer("verbosity", 0, "", short_name="v", flag_values=values)
  try:
    values(list(argv), known_only=True)
  except (flags.Error, OSError):
    return 0
  return values.verbosity


if __name__ == "__main__":
  console.start(requested_verbosity(sys.argv))  # Before TensorFlow starts.

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app

import dist_loop
from dist_loop import cluster as cluster_lib
from experiments import flags as run_flags
# pylint: enable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS


def verbosity() -> int:
  """--verbosity as absl's `app.run` leaves it: 0 unless given."""
  flag = FLAGS["verbosity"]
  return 0 if flag.using_default_value else flag.value


def main(argv) -> int:
  """Runs the parsed flags; a `UserError` is one line and an exit code."""
  console.setup(verbosity())
  try:
    if len(argv) > 1:
      raise dist_loop.UserError(f"unexpected arguments: {' '.join(argv[1:])};"
                                " every setting is a --flag")
    config = run_flags.to_config()
    summary = dist_loop.run(config, cluster=cluster_lib.current())
  except dist_loop.UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return e.exit_code
  acc = summary.get("eval_accuracy")
  print(f"done: step {summary['final_step']}, eval accuracy "
        f"{acc if acc is None else round(acc, 4)}, "
        f"{summary['examples_per_sec']:.0f} examples/sec")
  print(f"workdir: {config.workdir}")
  print(f"tensorboard: tensorboard --logdir {config.workdir}")
  return 0


if __name__ == "__main__":
  for name in run_flags.RUN_FLAGS:  # What --helpshort lists.
    flags.declare_key_flag(name)
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
