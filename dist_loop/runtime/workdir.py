"""The workdir as a careful database: one run at a time, checks before writes.

This module is the contract: the names of a run's files, the read-only
`check`, and the `Lock` a run holds (`dist_loop/runtime/lock.py`: an exclusive
`flock` on WORKDIR/lock, removed when the run ends, so a workdir looks the
same before and after a run that was refused). Checkpoints are found by
their names in `dist_loop/runtime/checkpoint_names.py`.

`train.run` writes in this order, so that a refused run leaves the workdir
as it was:

1. `check`, read-only: the workdir can be used, flags.txt is a readable
   flagfile with the same layout flags and optimizer, and no part of the run
   (checkpoints/, flags.txt, summary.json, tb/) is of the wrong kind: every
   file it will read or append to (the checkpoints' too) is a regular file,
   not a FIFO whose read would hang or a link to /dev/zero whose read never
   ends. It runs before TensorFlow joins a cluster, and again under the
   lock.
2. `Lock` (creates the workdir if needed, and removes it again if the run
   fails before writing anything in it).
3. The newest readable checkpoint is restored (`checkpoints.py`).
4. flags.txt, then the goodput record (`goodput.jsonl`, and
   `goodput.worker-1.jsonl` ... of the other processes: append-only, one
   line per inner loop, `dist_loop/runtime/goodput.py`), TensorBoard events and
   checkpoints, then summary.json.

Nothing here deletes or "repairs" what a user left in a workdir: an odd
state is reported with the path to move aside. This module does not import
TensorFlow, so a tool can take or test the lock cheaply.
"""

import glob
import os
import stat
from typing import List, Optional, Sequence

from dist_loop.core.config import Config
from dist_loop.core.errors import UserError
from dist_loop.runtime import goodput as _goodput
from dist_loop.runtime import launch_record as _launch_record
from dist_loop.runtime import lock as _lock
from dist_loop.runtime.checkpoint_names import CHECKPOINT_DIR
from dist_loop.runtime.checkpoint_names import CHECKPOINT_PREFIX, INDEX_FILE

FLAGS_FILE = "flags.txt"
SUMMARY_FILE = "summary.json"
GOODPUT_FILE = _goodput.GOODPUT_FILE
# The lock a run holds is part of the contract; `lock.py` is how it works.
LOCK_FILE = _lock.LOCK_FILE
Lock = _lock.Lock
lock_name = _lock.lock_name
# What a file that is not a regular one is, for the message refusing it.
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


# -- checks: read-only --


def check(config: Config, dirs: Sequence[str] = ()) -> None:
  """Refuses a workdir the run cannot use, without writing anything.

  Args:
    config: the run's configuration (`workdir`, `allow_config_change` and
      the layout flags).
    dirs: other directories the run writes under the workdir (TensorBoard's).

  Raises:
    UserError: naming the path and the fix.
  """
  root = config.workdir  # Not empty: `Config.validate` saw to that.
  _check_location(root)
  if not os.path.isdir(root):
    return  # A new run: nothing in it to check.
  for name in (CHECKPOINT_DIR, *dirs):
    _expect_kind(os.path.join(root, name), is_dir=True)
  for path in _files(root):
    _expect_kind(path, is_dir=False)
  _check_flags(config)


def _files(root: str) -> List[str]:
  """Every file of the workdir a run reads, appends to or replaces: its
  own, the other processes' goodput records and locks, the launcher's
  record, and the checkpoints' index and files (`checkpoint_names.py`)."""
  names = [FLAGS_FILE, SUMMARY_FILE, GOODPUT_FILE, INDEX_FILE, LOCK_FILE,
           os.path.join(_launch_record.LOG_DIR, _launch_record.FILE_NAME)]
  patterns = [f"{LOCK_FILE}.*", "goodput.*.jsonl",
              os.path.join(CHECKPOINT_DIR, f"{CHECKPOINT_PREFIX}-*.index"),
              os.path.join(CHECKPOINT_DIR, f"{CHECKPOINT_PREFIX}-*.data-*")]
  paths = [os.path.join(root, name) for name in names]
  for pattern in patterns:
    paths += sorted(glob.glob(os.path.join(glob.escape(root), pattern)))
  return paths


def _check_location(root: str) -> None:
  """The workdir is a directory, or can be created as one. (Whether a
  filesystem such as /proc accepts a new directory shows only when `Lock`
  creates it.)"""
  path = os.path.abspath(root)
  if os.path.exists(path):
    if not os.path.isdir(path):
      raise UserError(f"--workdir={root} is a file, not a directory; use "
                      "another --workdir, or move the file aside")
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
      raise UserError(f"--workdir={root} {_why_unwritable(path)}; use "
                      "another --workdir")
    return
  parent = path
  while not os.path.exists(parent):
    _refuse_dangling_link(parent, f"--workdir={root}")
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise UserError(f"--workdir={root} cannot be created: {parent} is a "
                    "file; use another --workdir")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise UserError(f"--workdir={root} cannot be created: {parent} "
                    f"{_why_unwritable(parent)}; use another --workdir")


def _why_unwritable(path: str) -> str:
  """Why this process cannot write in the directory `path`: its filesystem
  is mounted read-only (which holds for root too), or its permissions."""
  try:
    read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
  except OSError:
    read_only = False
  if read_only:
    return "is on a read-only filesystem"
  return "is not writable by this user"


def _refuse_dangling_link(path: str, what: str) -> None:
  """Raises if `path` is a symbolic link to nothing (it exists as a name,
  so it can be neither created nor used)."""
  if os.path.islink(path) and not os.path.exists(path):
    raise UserError(f"{what}: {path} is a symbolic link to "
                    f"{os.readlink(path)}, which does not exist; create that "
                    "directory, or remove the link")


def _expect_kind(path: str, is_dir: bool) -> None:
  if not os.path.lexists(path):
    return
  _refuse_dangling_link(path, "this workdir cannot be used")
  if os.path.isdir(path) != is_dir:
    what, should = (("a file", "a directory") if is_dir
                    else ("a directory", "a file"))
    raise UserError(f"{path} is {what}, but a run keeps {should} there; move "
                    "it aside (nothing was changed)")
  if not is_dir:
    _expect_regular(path)


def _expect_regular(path: str) -> None:
  """Raises if the file at `path` is a pipe, a device or a socket: a read
  of a FIFO waits for a writer that never comes, and one of /dev/zero
  never ends."""
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:  # Removed since (an old checkpoint, a lock).
    return
  except OSError as e:
    raise UserError(f"{path} cannot be examined ({e.strerror}); move it "
                    "aside, or fix its permissions (nothing was changed)"
                    ) from None
  if stat.S_ISREG(mode):
    return
  kind = next((what for test, what in _KINDS if test(mode)), "not a file")
  if os.path.islink(path):
    kind = f"a symbolic link to {os.readlink(path)}, {kind}"
  raise UserError(f"{path} is not a regular file ({kind}), but a run reads "
                  "and writes a file there; move it aside (nothing was "
                  "changed)")


def read_flags(path: str) -> str:
  """The text of a flags.txt, checked to be a flagfile.

  Raises:
    UserError: it cannot be read, is not UTF-8 text, is empty, or has a
      line that is not a flag or a comment.
  """
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise UserError(f"{path} cannot be read ({e.strerror}); move it aside, "
                    "or fix its permissions") from None
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise _not_a_flagfile(path, f"not UTF-8 text (byte {e.start})") from None
  lines = [line.strip() for line in text.splitlines()]
  flags = [line for line in lines if line.startswith("-")]
  bad = [line for line in lines
         if line and not line.startswith(("-", "#", "//"))]
  if bad:
    raise _not_a_flagfile(path, f"line {bad[0][:60]!r} is not a --flag")
  if not flags:
    raise _not_a_flagfile(path, "it holds no flags")
  return text


def _not_a_flagfile(path: str, why: str) -> UserError:
  return UserError(f"{path} is not a flagfile ({why}), so this run cannot be "
                   "checked against the one that wrote the workdir; move it "
                   "aside, or pass --allow_config_change to resume and "
                   "rewrite it")


def previous_flags(config: Config) -> Optional[str]:
  """The flags.txt a previous run left, or None (none, or not a flagfile:
  `check` refuses that unless --allow_config_change)."""
  path = os.path.join(config.workdir, FLAGS_FILE)
  try:
    return read_flags(path) if os.path.isfile(path) else None
  except UserError:
    return None


def _check_flags(config: Config) -> None:
  """flags.txt is a flagfile with the same layout flags and optimizer as
  `config`."""
  path = os.path.join(config.workdir, FLAGS_FILE)
  if config.allow_config_change or not os.path.exists(path):
    return
  previous = read_flags(path)
  old = config.optimizer_change(previous)
  if old is not None:
    raise UserError(
        f"{config.workdir} was trained with --optimizer={old}, and this run "
        f"asks for --optimizer={config.optimizer}; rerun with --optimizer="
        f"{old}, or pass --allow_config_change to start {config.optimizer}'s "
        "slots fresh")
  changes = config.layout_changes(previous)
  if changes:
    raise UserError(
        f"{config.workdir} holds a run with other settings "
        f"({'; '.join(changes)}). Use a new --workdir, restore the old values, "
        "or pass --allow_config_change to resume anyway")
