r"""Trains a model with a hand-written distributed loop.

    python -m experiments.train --flagfile=experiments/configs/default.flags \
        --workdir=runs/default

Rerunning the same command resumes from the workdir's latest checkpoint.
`--helpfull` lists every flag, with each mode's, model's and dataset's own
options under its name.
"""

import sys

from absl import app, flags

import dist_loop
from dist_loop import cluster as cluster_lib
from experiments import flags as run_flags

FLAGS = flags.FLAGS


def main(argv) -> int:
  """Runs the parsed flags; a `UserError` is one line and an exit code."""
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
