"""Where the text datasets' bytes come from, checked before they are read.

`--data_file` must be a regular file: a device such as /dev/zero never ends
and a pipe may never start, so both are refused by their kind, not found out
by a read that hangs or fills memory. Its size is known before it is read,
so `data/text.py` can refuse one too short for a window, or too large for
the memory available, without reading it. `pysource` is a fixed list of the
running Python's standard-library modules.
"""

import os
import resource
import stat
import sysconfig
from typing import Optional, Sequence

from dist_loop.core.errors import UserError

# Large, pure-Python modules that have kept their path for many releases.
PYSOURCE_FILES = (
    "_pydecimal.py", "inspect.py", "typing.py", "pydoc.py",
    "email/_header_value_parser.py", "tarfile.py", "doctest.py",
    "argparse.py", "subprocess.py", "difflib.py", "logging/__init__.py",
    "enum.py", "pickle.py",
)


def file_size(path: str) -> int:
  """The size of --data_file, which must be a regular file.

  Raises:
    UserError: it is missing, a directory, a device, a pipe or a socket, or
      cannot be examined.
  """
  try:
    info = os.stat(os.path.expanduser(path))
  except OSError as e:
    raise _unreadable(path, e) from None
  if stat.S_ISDIR(info.st_mode):
    raise UserError(f"--data_file={path} is a directory; pass a file")
  if not stat.S_ISREG(info.st_mode):
    raise UserError(f"--data_file={path} is not a regular file (a device, "
                    "a pipe or a socket); pass a file")
  return info.st_size


def read_file(path: str) -> bytes:
  """The bytes of `path` for --data_file. Raises a one-line UserError."""
  try:
    with open(os.path.expanduser(path), "rb") as f:
      return f.read()
  except OSError as e:
    raise _unreadable(path, e) from None


def _unreadable(path: str, error: OSError) -> UserError:
  if isinstance(error, FileNotFoundError):
    return UserError(f"--data_file={path}: no such file; pass the path of an "
                     "existing file")
  if isinstance(error, IsADirectoryError):
    return UserError(f"--data_file={path} is a directory; pass a file")
  return UserError(f"--data_file={path} cannot be read "
                   f"({error.strerror or error}); check its permissions, or "
                   "pass another file")


def available_memory() -> Optional[int]:
  """Bytes this process can still allocate: the system's available memory,
  or less under an address-space limit (`ulimit -v`); None if unknown."""
  limits = []
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          limits.append(int(line.split()[1]) * 1024)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
      with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
      limits.append(max(soft - used, 0))
  except (OSError, ValueError, IndexError):
    return None
  return min(limits) if limits else None


def pysource_bytes(stdlib_dir: Optional[str] = None,
                   files: Sequence[str] = PYSOURCE_FILES) -> bytes:
  """The `pysource` corpus: `files` of the standard library, concatenated
  in order. Raises a UserError naming the first missing file."""
  stdlib_dir = stdlib_dir or sysconfig.get_paths()["stdlib"]
  parts = []
  for name in files:
    path = os.path.join(stdlib_dir, name)
    try:
      with open(path, "rb") as f:
        parts.append(f.read())
    except OSError as e:
      raise UserError(
          f"--dataset=pysource reads the Python standard library, but {path} "
          f"cannot be read ({e.strerror or e}); use a complete Python "
          "installation, or --dataset=text --data_file=PATH") from None
  return b"".join(parts)
