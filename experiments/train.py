r"""Trains a model with a hand-written distributed loop.

    python -m experiments.train --flagfile=experiments/configs/default.flags \
        --workdir=runs/default

Rerunning the same command resumes from the workdir's latest checkpoint.
`--helpfull` lists every flag, with each mode's, model's and dataset's own
options under its name. The terminal shows the run's own lines only;
`--verbosity=1` adds TensorFlow's warnings, `--verbosity=2` everything
(`dist_loop/runtime/console.py`).

Flagfiles are read here, before absl parses (`expand_flagfiles`): a nested
`--flagfile` is found next to the file that names it, so a flagfile works
from any directory. Ctrl-C at any moment ends the command with one line and
exit code 130: during start-up (imports, flag parsing) at once, as nothing
has been written yet; once `main` runs, as a KeyboardInterrupt, so that the
run releases what it holds (the controller saves a checkpoint first). A
process started with Ctrl-C ignored keeps ignoring it.
"""

import codecs
import os
import signal
import sys
from typing import List, Sequence, Tuple

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
from absl import flags

from dist_loop.runtime import console, process_exit
# pylint: enable=g-import-not-at-top,wrong-import-position

_FLAGFILE = ("--flagfile", "-flagfile")


class FlagfileError(Exception):
  """A flagfile that cannot be used; the message names it and the fix."""


def expand_flagfiles(argv: Sequence[str]) -> List[str]:
  """`argv` with each `--flagfile` replaced by the flags its file holds.

  As absl reads flagfiles (one argument per line, lines starting with `#`
  or `//` are comments, a file may name another with `--flagfile=PATH`,
  later flags win, nothing after `--` is read), except:

  * a relative nested `--flagfile=PATH` is looked up next to the file that
    names it first, then in the current directory (absl's only rule, so
    flagfiles written for it keep working);
  * files are read as UTF-8, and a leading byte-order mark is ignored;
  * a file that cannot be read or decoded, or that includes itself, is a
    `FlagfileError` naming it (absl gives a traceback for an undecodable
    file and skips a loop with a warning).

  Raises:
    FlagfileError: naming the file and the fix.
  """
  out, args = list(argv[:1]), list(argv[1:])
  while args:
    arg = args.pop(0)
    if arg == "--":
      out += [arg] + args
      break
    if arg in _FLAGFILE:
      if not args:
        raise FlagfileError(f"{arg} needs a file name: {arg}=PATH")
      path = args.pop(0)
    elif arg.startswith(tuple(f + "=" for f in _FLAGFILE)):
      path = arg.split("=", 1)[1]
    else:
      out.append(arg)
      continue
    out += _read_flagfile(os.path.expanduser(path.strip()), ())
  return out


def _read_flagfile(path: str, including: Tuple[str, ...]) -> List[str]:
  """The arguments in flagfile `path`, nested flagfiles expanded.
  `including`: the files that led here, outermost first."""
  if not path:
    return []  # As absl: an empty --flagfile= names nothing.
  named = f"--flagfile={path}" + (f" (named in {including[-1]})"
                                  if including else "")
  if os.path.realpath(path) in map(os.path.realpath, including):
    raise FlagfileError(f"{named} includes itself: "
                        f"{' -> '.join(including + (path,))}; remove the "
                        "loop")
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise FlagfileError(f"cannot read {named}: {e.strerror}") from None
  bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
  try:
    text = data[bom:].decode("utf-8")
  except UnicodeDecodeError as e:
    offset = bom + e.start
    raise FlagfileError(
        f"{named} is not UTF-8 text (byte 0x{data[offset]:02x} at offset "
        f"{offset}); save it as UTF-8") from None
  args = []
  for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
    line = line.strip()
    if not line or line.startswith(("#", "//")):
      continue
    if line in _FLAGFILE:
      raise FlagfileError(f"{named} has a line {line} without a file name; "
                          f"write {line}=PATH")
    if line.startswith(tuple(f + "=" for f in _FLAGFILE)):
      nested = os.path.expanduser(line.split("=", 1)[1].strip())
      args += _read_flagfile(_beside(nested, path), including + (path,))
    else:
      args.append(line)
  return args


def _beside(nested: str, including: str) -> str:
  """Where a nested flagfile is: next to the file that names it, else
  (absl's rule) relative to the current directory."""
  if not nested or os.path.isabs(nested):
    return nested
  beside = os.path.join(os.path.dirname(including), nested)
  return nested if os.path.exists(nested) and not os.path.exists(
      beside) else beside


def requested_verbosity(argv) -> int:
  """`--verbosity` (or `-v`) from a command line and its flagfiles, read
  before the flags below exist; 0 if absent or unreadable (the real parse
  reports the error)."""
  values = flags.FlagValues()
  flags.DEFINE_integer("verbosity", 0, "", short_name="v", flag_values=values)
  try:
    values(list(argv), known_only=True)
  except (flags.Error, OSError, ValueError):
    return 0
  return values.verbosity


if __name__ == "__main__":
  try:
    _ARGV = expand_flagfiles(sys.argv)
  except FlagfileError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(1)
  process_exit.skip_final_gc()
  console.start(requested_verbosity(_ARGV))  # Before TensorFlow starts.

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app

import dist_loop
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
    summary = dist_loop.run(config, cluster=run_flags.cluster())
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
  for name in run_flags.RUN_FLAGS:  # What --helpshort lists.
    flags.declare_key_flag(name)
  flags.mark_flags_as_required(["workdir"])
  app.run(_main_interruptible, argv=_ARGV)
