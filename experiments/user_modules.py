"""`--user_modules`: the user's own code, imported before the flags exist.

A researcher's model, dataset, mode, policy, schedule, compressor or task
lives in their own module and registers itself when imported. The entry
point imports the modules `--user_modules` names after TensorFlow started
(quietly) and before the flags are generated (`experiments/flags.py`), so
their components are valid choices and their options are flags, listed in
`--helpfull` like the library's own.

Each item is a module name importable from `sys.path`
(`experiments.extensions.randomk`, `mypackage.models`), or a path (it has a
`/` or ends in `.py`) to a `.py` file or a package directory, anywhere. A
path's directory goes first on `sys.path`, so the module imports its
siblings by name, as a script does. `--user_modules` is read from the
command line and its flagfiles before absl parses
(`flagfiles.requested_user_modules`), and flags.txt records it with paths
made absolute (`recorded`), so the run's own flags.txt, or the same command
from any directory, resumes it.
"""

import importlib
import os
import signal
import sys
import traceback
from typing import List, Sequence

from absl import flags

from dist_loop.core.errors import UserError

flags.DEFINE_list(
    "user_modules", [], "Your own modules, imported before the flags are "
    "made, so that the models, datasets, modes and other components they "
    "register (and their options) can be chosen by flag. Comma-separated "
    "module names importable from sys.path, or paths to a .py file or a "
    "package directory.", module_name="your code")


class UserModuleError(UserError):
  """A user module that cannot be imported. Exit code 2: nothing ran."""

  exit_code = 2


def is_path(item: str) -> bool:
  """Whether a `--user_modules` item names a file or directory (else a
  module name)."""
  return os.sep in item or "/" in item or item.endswith(".py")


def recorded(items: Sequence[str]) -> List[str]:
  """`items` as flags.txt records them: paths absolute, names as given."""
  return [os.path.abspath(os.path.expanduser(i)) if is_path(i) else i
          for i in items]


def load(items: Sequence[str]) -> None:
  """Imports each user module, in order.

  Raises:
    UserModuleError: one line naming the item and the cause (not found, a
      syntax error, or what its import raised, with the file and line).
  """
  for item in items:
    try:
      if is_path(item):
        _import_path(item)
      else:
        _import_name(item)
    except UserModuleError:
      raise
    except (SystemExit, KeyboardInterrupt) as e:
      # A real Ctrl-C during start-up never gets here (the entry point exits
      # at once: `train.exit_on_ctrl_c`); where Ctrl-C raises, it may.
      if isinstance(e, KeyboardInterrupt) and _ctrl_c_raises():
        raise
      raise _failed(item, f"{type(e).__name__}: {_one_line(e)}{_where(e)}; "
                    "a module must not exit while imported") from None
    except SyntaxError as e:
      where = f"{os.path.basename(e.filename or '?')}:{e.lineno}"
      raise _failed(item, f"SyntaxError: {e.msg} ({where})") from None
    except Exception as e:  # pylint: disable=broad-except
      raise _failed(item, f"{type(e).__name__}: {_one_line(e)}"
                    f"{_where(e)}") from None


def _import_name(name: str) -> None:
  if not all(part.isidentifier() for part in name.split(".")):
    raise _failed(name, "not a module name nor a path (a path has a / or "
                  "ends in .py)")
  try:
    importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name and (name == e.name or name.startswith(e.name + ".")):
      raise _failed(name, f"no module named {e.name!r} on sys.path; give "
                    "its path, or run from the directory above it") from None
    raise


def _import_path(item: str) -> None:
  path = os.path.abspath(os.path.expanduser(item))
  if os.path.isdir(path):
    name, init = os.path.basename(path), os.path.join(path, "__init__.py")
    if os.path.exists(init) and not os.path.isfile(init):
      raise _failed(item, f"{init} is not a regular file; give a package "
                    "directory or a .py file")
    if not os.path.isfile(init):
      raise _failed(item, "a directory without __init__.py; give a package "
                    "directory or a .py file")
  elif os.path.isfile(path) and path.endswith(".py"):
    name, init = os.path.basename(path)[:-len(".py")], path
  elif os.path.exists(path) and not os.path.isfile(path):
    # A FIFO, device or socket (or a link to one): never opened.
    raise _failed(item, "not a regular file (a FIFO, device or socket); "
                  "give a .py file or a package directory")
  else:
    raise _failed(item, "no such .py file or package directory")
  if not name.isidentifier():
    raise _failed(item, f"{name!r} is not a valid module name; rename it")
  taken = sys.modules.get(name)
  if taken is not None and not _same_file(taken, init):
    raise _failed(item, f"the module name {name!r} is taken by "
                  f"{getattr(taken, '__file__', None) or 'a built-in module'}"
                  "; rename the file")
  directory = os.path.dirname(path)
  if directory not in sys.path:
    sys.path.insert(0, directory)
  module = importlib.import_module(name)
  if not _same_file(module, init):
    raise _failed(item, f"{name!r} imports as {module.__file__}, which comes "
                  "first on sys.path; rename the file")


def _same_file(module, path: str) -> bool:
  file = getattr(module, "__file__", None)
  return bool(file) and os.path.realpath(file) == os.path.realpath(path)


def _ctrl_c_raises() -> bool:
  """Whether Ctrl-C raises KeyboardInterrupt now (Python's own handler),
  so that one may be the user's, not the module's."""
  return signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _one_line(error: BaseException) -> str:
  return " ".join(str(error).split()) or "(no message)"


def _where(error: BaseException) -> str:
  """` (file.py:LINE)`: the last frame of the traceback outside this
  module and importlib, where the user's code raised."""
  frames = [f for f in traceback.extract_tb(error.__traceback__)
            if f.filename != __file__ and "importlib" not in f.filename]
  return (f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
          if frames else "")


def _failed(item: str, cause: str) -> UserModuleError:
  return UserModuleError(f"--user_modules={item}: cannot import it: {cause}")
