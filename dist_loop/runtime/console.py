"""The terminal of a run: our own lines, and other libraries' only on request.

At the default `--verbosity=0` a run prints its own lines only: the start
banner, one progress line per log interval, eval and checkpoint lines, its
warnings and errors, and the final summary. A failure is one `error:` line;
what TensorFlow and gRPC logged about it (a lost peer gives dozens of lines)
is shown from `--verbosity=1` on. TensorFlow, Keras and absl log through the
same Python loggers and the same absl handler as we do, and TensorFlow's C++
side writes straight to file descriptor 2, so quieting them takes three
steps:

* `start(verbosity)`, before TensorFlow is imported: the C++ log level
  (`TF_CPP_MIN_LOG_LEVEL`, read once, at TensorFlow's first native log line;
  `--verbosity` sets it whatever the environment says, so one flag rules the
  terminal), and the import itself with its native start-up notices (oneDNN,
  absl's pre-initialisation warning) filtered out; some of them ignore
  `TF_CPP_MIN_LOG_LEVEL`. The import is `tf_import.import_tensorflow`'s,
  which spares it a plotting library.
* `setup(verbosity)`, once flags are parsed: a filter on absl's handler that
  tells our records (logged from dist_loop/, experiments/, tools/) from
  everyone else's, the `tensorflow` logger's level, and a short line format.

| --verbosity | our lines             | TensorFlow, Keras, absl (Python, C++) |
| ----------- | --------------------- | ------------------------------------- |
| -1, -2      | warnings, errors only | fatal only                            |
| 0 (default) | info and up           | fatal only                            |
| 1           | debug and up          | warnings and errors                   |
| 2 and up    | everything            | everything                            |

From 2 on, lines have absl's own prefix (severity, time, thread, file:line).

`banner(...)` formats the run's first line.
"""

import contextlib
import functools
import logging
import os
import re
import sys
import tempfile
from typing import Sequence

from absl import logging as absl_logging

from dist_loop.runtime import tf_import

_REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
OUR_DIRS = tuple(os.path.join(_REPO, name) + os.sep
                 for name in ("dist_loop", "experiments", "tools"))
# A native (glog/absl) log line: severity letter, then MMDD.
_NATIVE_LINE = re.compile(r"^([IWEF])\d{4} ")
_NATIVE_NOTICE = "All log messages before absl::InitializeLog() is called"
_SEVERITY = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR,
             "F": logging.CRITICAL}


def library_level(verbosity: int) -> int:
  """The lowest level shown of other libraries' records."""
  if verbosity >= 2:
    return logging.NOTSET
  return logging.WARNING if verbosity == 1 else logging.CRITICAL


def native_log_level(verbosity: int) -> str:
  """`TF_CPP_MIN_LOG_LEVEL` for `verbosity` (0 info, 1 warning, 2 error,
  3 fatal), as `library_level` filters Python records."""
  return {2: "0", 1: "1"}.get(min(verbosity, 2), "3")


def our_level(verbosity: int) -> int:
  """The lowest level shown of our own records (absl's meaning)."""
  if verbosity >= 1:
    return logging.DEBUG
  return {0: logging.INFO, -1: logging.WARNING}.get(verbosity, logging.ERROR)


def start(verbosity: int) -> None:
  """Before TensorFlow's import: its native log level, and the import with
  its native start-up notices filtered, at `verbosity`."""
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = native_log_level(verbosity)
  if "tensorflow" in sys.modules:
    return
  with contextlib.ExitStack() as stack:
    if verbosity < 2:
      stack.enter_context(native_stderr_filtered(verbosity))
    tf_import.import_tensorflow()


def keep_native_line(line: str, verbosity: int) -> bool:
  """Whether a line TensorFlow's native side wrote to stderr is shown.
  Lines that are not native log lines (Python's own warnings) always are."""
  if _NATIVE_NOTICE in line:
    return verbosity >= 2
  match = _NATIVE_LINE.match(line)
  return not match or _SEVERITY[match.group(1)] >= library_level(verbosity)


@contextlib.contextmanager
def native_stderr_filtered(verbosity: int):
  """File descriptor 2 goes to a temporary file inside the block; then the
  lines that `keep_native_line` keeps are written to stderr. Only for
  single-threaded start-up code: every thread's output is held back."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      text = held.read().decode("utf-8", "replace")
      sys.stderr.write("".join(
          line for line in text.splitlines(keepends=True)
          if keep_native_line(line, verbosity)))
      sys.stderr.flush()


@functools.lru_cache(maxsize=None)
def is_ours(path: str) -> bool:
  """Whether a source file is part of this repository's code."""
  return os.path.realpath(path).startswith(OUR_DIRS)


class QuietFilter(logging.Filter):
  """Passes our records from `our_level`, others' from `library_level`."""

  def __init__(self, verbosity: int):
    super().__init__()
    self.verbosity = verbosity

  def filter(self, record: logging.LogRecord) -> bool:
    ours = record.name != "tensorflow" and is_ours(record.pathname)
    return record.levelno >= (our_level(self.verbosity) if ours
                              else library_level(self.verbosity))


class ShortFormatter(logging.Formatter):
  """`HH:MM:SS message`, with `warning: ` or `error: ` before the message
  of those."""

  def __init__(self):
    super().__init__("%(message)s")

  def format(self, record: logging.LogRecord) -> str:
    label = ("" if record.levelno < logging.WARNING
             else ("warning: " if record.levelno < logging.ERROR
                   else "error: "))
    return (f"{self.formatTime(record, '%H:%M:%S')} {label}"
            f"{super().format(record)}")


def setup(verbosity: int) -> None:
  """Filters and formats the terminal for `verbosity` (see the table above).
  Safe to call again: the last call wins."""
  handler = absl_logging.get_absl_handler()
  for old in [f for f in handler.filters if isinstance(f, QuietFilter)]:
    handler.removeFilter(old)
  handler.addFilter(QuietFilter(verbosity))
  handler.setFormatter(ShortFormatter() if verbosity < 2
                       else absl_logging.PythonFormatter())
  tf_logger = logging.getLogger("tensorflow")
  # TensorFlow adds a handler of its own when the root logger had none yet;
  # its records then showed twice. They go through absl's handler only.
  for own in list(tf_logger.handlers):
    tf_logger.removeHandler(own)
  tf_logger.setLevel(library_level(verbosity))


def banner(config, devices: Sequence[str], model, dataset) -> str:
  """The run's first line: mode, devices, model size, data size, schedule."""
  params = sum(int(v.shape.num_elements()) for v in model.trainable_variables)
  names = ", ".join(d.rsplit("device:", 1)[-1] for d in devices)
  count = f"{len(devices)} device{'s' if len(devices) != 1 else ''}"
  return (f"{config.mode} on {count} ({names})  |  {config.model}: "
          f"{params:,} parameters  |  {config.dataset}: "
          f"{len(dataset.train_y):,} train / {len(dataset.eval_y):,} eval "
          f"examples  |  {config.train_steps:,} steps of "
          f"{config.global_batch_size}")
