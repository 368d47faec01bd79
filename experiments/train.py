r"""Trains a model with a hand-written distributed loop.

    python -m experiments.train --flagfile=experiments/configs/default.flags \
        --workdir=runs/default

Rerunning the same command resumes from the workdir's latest checkpoint.
`--helpfull` lists every flag, with each mode's, model's and dataset's own
options under its name. The terminal shows the run's own lines only;
`--verbosity=1` adds TensorFlow's warnings, `--verbosity=2` everything
(`dist_loop/runtime/console.py`).

Before absl parses, the command line's flagfiles are read
(`experiments/flagfiles.py`: a nested `--flagfile` is found next to the
file that names it, so a flagfile works from any directory), TensorFlow
starts quietly (`experiments/startup.py`), and the modules of
`--user_modules` are imported (`experiments/user_modules.py`), so the
flags generated next (`experiments/flags.py`) include their components'
options. A command line that cannot be read that far is one line and exit
code 2. Ctrl-C at any moment ends the command with one line and
exit code 130: during start-up (imports, flag parsing) at once, as nothing
has been written yet; once `main` runs, as a KeyboardInterrupt, so that the
run releases what it holds (the controller saves a checkpoint first). A
process started with Ctrl-C ignored keeps ignoring it.
"""

import importlib
import os
import signal
import sys
from typing import List

# Ctrl-C before `main`: nothing to clean up, so exit at once. The line goes
# to the terminal's stderr, saved here, because start-up may point file
# descriptor 2 elsewhere for a while (console.native_stderr_filtered).
_STDERR = os.dup(2) if __name__ == "__main__" else 2
# A process started with Ctrl-C ignored (a script's background job, which
# shares the terminal's Ctrl-C with the script) keeps ignoring it.
_CTRL_C_IGNORED = signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def exit_on_ctrl_c(when: str) -> None:
  """From now on, Ctrl-C prints one line, `error: interrupted (Ctrl-C)
  WHEN`, and exits with code 130 at once (unless it is ignored)."""
  if _CTRL_C_IGNORED:
    return
  line = f"error: interrupted (Ctrl-C) {when}\n".encode()

  def interrupted(signum, frame):  # pylint: disable=unused-argument
    os.write(_STDERR, line)
    os._exit(130)  # pylint: disable=protected-access

  signal.signal(signal.SIGINT, interrupted)


if __name__ == "__main__":
  exit_on_ctrl_c("during start-up; nothing was written")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app, flags

import dist_loop
from dist_loop.runtime import console
from experiments import flagfiles, startup, user_modules
# pylint: enable=g-import-not-at-top,wrong-import-position


def before_the_flags(argv: List[str]) -> List[str]:
  """What runs before the flags exist: the flagfiles read, TensorFlow
  started quietly, the user's modules imported, the flags generated.
  Returns the command line with its flagfiles expanded; a command line
  that cannot be read is one line and exit code 2, with nothing created."""
  try:
    argv = flagfiles.expand_flagfiles(argv)
    startup.start(flagfiles.requested_verbosity(argv))
    load_user_code(argv)
  except dist_loop.UserError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(error.exit_code)
  return argv


def load_user_code(argv: List[str]) -> None:
  """Imports the modules of `--user_modules` in `argv` (flagfiles
  expanded), then defines the flags of every registered component.

  Raises:
    UserModuleError: a module cannot be imported, or an option of a
      component it registered has the name of another flag.
  """
  items = flagfiles.requested_user_modules(argv)
  user_modules.load(items)
  try:  # The first import generates every flag; later, the new ones.
    importlib.import_module("experiments.flags").define_component_flags()
  except ValueError as error:
    raise user_modules.UserModuleError(
        f"--user_modules={','.join(items)}: {error}") from None


if __name__ == "__main__":
  _ARGV = before_the_flags(sys.argv)

# pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import flags as run_flags
# pylint: enable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS


def verbosity() -> int:
  """--verbosity as absl's `app.run` leaves it: 0 unless given."""
  flag = FLAGS["verbosity"]
  return 0 if flag.using_default_value else flag.value


def done_line(summary) -> str:
  """The last line of a run: its step, the task's evaluation (whatever
  metrics summary.json has: accuracy for a classifier, bits per byte and
  accuracy for a language model; the loss if nothing else) and its speed."""
  evals = [(k[len("eval_"):], v) for k, v in summary.items()
           if k.startswith("eval_") and not isinstance(v, (bool, str))]
  shown = [(k, v) for k, v in evals if k != "loss"] or evals
  metrics = ", ".join(
      f"{k.replace('_', ' ')} {'n/a' if v is None else round(v, 4)}"
      for k, v in shown)
  speed = summary.get("examples_per_sec")
  return (f"done: step {summary['final_step']}, "
          f"{'eval ' + metrics if metrics else 'no evaluation'}"
          + ("" if speed is None else f", {speed:.0f} examples/sec"))


def main(argv) -> int:
  """Runs the parsed flags; a `UserError` is one line and an exit code."""
  console.setup(verbosity())
  try:
    if len(argv) > 1:
      raise dist_loop.UserError(f"unexpected arguments: {' '.join(argv[1:])};"
                                " every setting is a --flag")
    config = run_flags.to_config()
    summary = dist_loop.run(config, run_flags.to_flagfile(),
                            cluster=run_flags.cluster())
  except dist_loop.UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return e.exit_code
  except KeyboardInterrupt:
    print("error: interrupted (Ctrl-C); rerun the same command to resume",
          file=sys.stderr)
    return 130
  print(done_line(summary))
  print(f"workdir: {config.workdir}")
  print(f"tensorboard: tensorboard --logdir {config.workdir}")
  return 0


def parse_flags(argv: List[str]) -> List[str]:
  """absl's parse (a bad value: its usage line and exit code 1), and one
  line for what absl raises as a ValueError instead (a value given to a
  boolean's --noNAME form)."""
  try:
    return app.parse_flags_with_usage(argv)
  except ValueError as error:
    print(bad_form_line(error), file=sys.stderr)
    sys.exit(2)


def bad_form_line(error: ValueError) -> str:
  return (f"error: {error}: give a boolean flag as --NAME, --noNAME or "
          "--NAME=VALUE")


def _main_interruptible(argv) -> int:
  """`main`, with Ctrl-C raised as KeyboardInterrupt inside it (the run's
  cleanup runs), and an immediate exit again once it returned."""
  if not _CTRL_C_IGNORED:
    signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    return main(argv)
  finally:
    sys.stdout.flush()
    exit_on_ctrl_c("while exiting")


if __name__ == "__main__":
  for name in ("user_modules",) + run_flags.RUN_FLAGS:  # --helpshort's.
    flags.declare_key_flag(name)
  flags.mark_flags_as_required(["workdir"])
  app.run(_main_interruptible, argv=_ARGV, flags_parser=parse_flags)
