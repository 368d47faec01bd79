"""The terminal of a run: our own lines, and other libraries' only on request.

At the default `--verbosity=0` a run prints its own lines only: the start
banner, one progress line per log interval, eval and checkpoint lines, its
warnings and errors, and the final summary. The user's own code (a module
of `--user_modules`, or any program calling the library) is the run's too:
its info lines and warnings show like the library's. A failure is one
`error:` line; what TensorFlow and gRPC logged about it (a lost peer gives
dozens of lines) is shown from `--verbosity=1` on. TensorFlow, Keras and
absl log through the same Python loggers and the same absl handler as we
do, and TensorFlow's C++ side writes straight to file descriptor 2, so
quieting them takes two steps:

* `start(verbosity)`, before TensorFlow is imported: the C++ log level
  (`TF_CPP_MIN_LOG_LEVEL`, read once, at TensorFlow's first native log line,
  which its import writes; `--verbosity` sets it whatever the environment
  says, so one flag rules the terminal), and TensorFlow's import itself with
  its native start-up notices (oneDNN, absl's pre-initialisation warning)
  filtered out; some of them ignore `TF_CPP_MIN_LOG_LEVEL`. (The entry
  points make that import cheaper: `experiments/startup.py`.) A process
  forked after `start` imported TensorFlow (a task of tools.launch's fork
  server, `tools/fork_server.py`) calls `start` again with its own
  verbosity: the level is then set where TensorFlow's import put it,
  absl's minimum log level in TensorFlow's native library
  (`_set_native_level`).
* `setup(verbosity)`, once flags are parsed: a filter on absl's handler that
  tells the libraries' records from everyone else's, the `tensorflow`
  logger's level, and a short line format. A record is a library's by its
  logger's name (`LIBRARIES`: `tensorflow`, `keras`, `absl`, ...; Python's
  captured warnings, `py.warnings`); a record of the loggers everyone
  shares (absl's `absl`, Python's root) is a library's if the code that
  logged it is in one of those packages. So a user's module logs like the
  library wherever it lives.

| --verbosity | the run's (ours, user's) | TensorFlow, Keras, absl (Python, C++) |
| ----------- | ------------------------ | ------------------------------------- |
| -1, -2      | warnings, errors only    | fatal only                            |
| 0 (default) | info and up              | fatal only                            |
| 1           | debug and up             | warnings and errors                   |
| 2 and up    | everything               | everything                            |

From 2 on, lines have absl's own prefix (severity, time, thread, file:line).

`banner(...)` formats the run's first line.
"""

import contextlib
import ctypes
import functools
import importlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
from typing import Sequence

from absl import logging as absl_logging

# The libraries whose records are quiet at --verbosity=0, by logger name
# and by the package of the code that logged through a shared logger.
LIBRARIES = ("absl", "keras", "tensorboard", "tensorflow", "tf_keras",
             "py.warnings")
# The loggers whose name says nothing of who logged: absl's and the root.
_SHARED_LOGGERS = ("absl", "root")
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


# The native log level TensorFlow was imported with by `start`, if it was.
_imported_at = []


def start(verbosity: int) -> None:
  """Before TensorFlow's import: its native log level, and the import with
  its native start-up notices filtered, at `verbosity`. After an import by
  an earlier `start` (in the process this one was forked from): the level
  only."""
  level = native_log_level(verbosity)
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = level
  if "tensorflow" in sys.modules:
    if _imported_at and _imported_at[-1] != level and _set_native_level(
        level):
      _imported_at.append(level)
    return
  with contextlib.ExitStack() as stack:
    if verbosity < 2:
      stack.enter_context(native_stderr_filtered(verbosity))
    importlib.import_module("tensorflow")
  _imported_at.append(level)


def _set_native_level(level: str) -> bool:
  """Sets the native log level of an imported TensorFlow: absl's
  `SetMinLogLevel` in libtensorflow_framework, which TensorFlow's import
  called with TF_CPP_MIN_LOG_LEVEL. Its name holds absl's inline namespace,
  read from the headers TensorFlow ships. Returns whether it could; if not
  (another TensorFlow build), the level stays the import's."""
  try:
    spec = importlib.util.find_spec("tensorflow")
    root = os.path.dirname(spec.origin)
    with open(os.path.join(root, "include", "absl", "base", "options.h"),
              encoding="utf-8") as f:
      found = re.search(r"^#define ABSL_OPTION_INLINE_NAMESPACE_NAME (\w+)$",
                        f.read(), re.MULTILINE)
    library = ctypes.CDLL(os.path.join(root, "libtensorflow_framework.so.2"))
    name = found.group(1)
    setter = getattr(library, f"_ZN4absl{len(name)}{name}14SetMinLogLevelENS0_"
                     "18LogSeverityAtLeastE")
  except (OSError, AttributeError, TypeError):
    return False
  setter(ctypes.c_int(int(level)))
  return True


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
def _library_dirs():
  """The directory of each installed package of `LIBRARIES`, found
  without importing it."""
  dirs = []
  for name in LIBRARIES:
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      spec = None
    if spec is not None and spec.submodule_search_locations:
      dirs += [os.path.realpath(d) + os.sep
               for d in spec.submodule_search_locations]
  return tuple(dirs)


@functools.lru_cache(maxsize=None)
def _in_library(path: str) -> bool:
  return os.path.realpath(path).startswith(_library_dirs())


def is_library_record(record: logging.LogRecord) -> bool:
  """Whether a record is one of `LIBRARIES`': by its logger's name, or for
  a shared logger (absl's, the root), by the package that logged it."""
  if record.name in _SHARED_LOGGERS:
    return _in_library(record.pathname)
  return record.name.split(".")[0] in LIBRARIES or record.name in LIBRARIES


class QuietFilter(logging.Filter):
  """Passes the run's records (the library's and the user's) from
  `our_level`, the libraries' from `library_level`."""

  def __init__(self, verbosity: int):
    super().__init__()
    self.verbosity = verbosity

  def filter(self, record: logging.LogRecord) -> bool:
    ours = not is_library_record(record)
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


def banner(config, devices: Sequence[str], model, dataset,
           cluster=None) -> str:
  """The run's first line: mode, devices (and the cluster's tasks, in a
  run of several processes), model size, data size, schedule."""
  params = sum(int(v.shape.num_elements()) for v in model.trainable_variables)
  names = ", ".join(d.rsplit("device:", 1)[-1] for d in devices)
  where = f"{len(devices)} device{'s' if len(devices) != 1 else ''} ({names})"
  if cluster is not None and cluster.num_tasks > 1:
    plural = lambda job, n: job + ("s" if n != 1 and job != "ps" else "")
    jobs = ", ".join(f"{len(a)} {plural(job, len(a))}"
                     for job, a in cluster.spec.items())
    where = f"{jobs}, this one {cluster.task_name} on {where}"
  return (f"{config.mode} on {where}  |  {config.model}: "
          f"{params:,} parameters  |  {config.dataset}: "
          f"{len(dataset.train_y):,} train / {len(dataset.eval_y):,} eval "
          f"examples  |  {config.train_steps:,} steps of "
          f"{config.global_batch_size}")
