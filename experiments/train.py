r"""Trains a model with a hand-written distributed loop.

    python -m experiments.train --flagfile=experiments/configs/default.flags \
        --workdir=runs/default

Rerunning the same command resumes from the workdir's latest checkpoint.
"""

import sys

from absl import app, flags

import dist_loop
from experiments import extensions  # pylint: disable=unused-import
from experiments import flags as run_flags

FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    config = run_flags.to_config()
    summary = dist_loop.run(config, flags_text=run_flags.to_flagfile())
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
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
