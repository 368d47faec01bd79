"""The workdir as a careful database: one run at a time, checks before writes.

A run owns its workdir through an exclusive OS lock, `fcntl.flock` on
WORKDIR/lock (WORKDIR/lock.worker-1 etc. for the other processes of a
multi-worker run), which the kernel releases when the process ends, however
it ends. A second run on the same workdir fails at once, naming the PID that
holds it. The lock file is removed when the run ends, so a workdir looks the
same before and after a run that was refused.

`train.run` writes in this order, so that a refused run leaves the workdir
as it was:

1. `check`, read-only: the workdir can be used, flags.txt is a readable
   flagfile with the same layout flags, and no part of the run
   (checkpoints/, flags.txt, summary.json, tb/) is of the wrong kind. It runs
   before TensorFlow joins a cluster, and again under the lock.
2. `Lock` (creates the workdir if needed, and removes it again if the run
   fails before writing anything in it).
3. The newest readable checkpoint is restored (`checkpoints.py`).
4. flags.txt, then TensorBoard events and checkpoints, then summary.json.

Nothing here deletes or "repairs" what a user left in a workdir: an odd
state is reported with the path to move aside. This module does not import
TensorFlow, so a tool can take or test the lock cheaply.
"""

import fcntl
import os
import time
from typing import List, Optional, Sequence

from dist_loop.config import Config
from dist_loop.errors import UserError

FLAGS_FILE = "flags.txt"
SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "checkpoints"
INDEX_FILE = os.path.join(CHECKPOINT_DIR, "checkpoint")  # TensorFlow's.
LOCK_FILE = "lock"
_PID_READ_TRIES = 20  # The holder writes its PID just after it locks.
_OPEN_TRIES = 5


def lock_name(task_type: Optional[str], task_index: int,
              is_chief: bool) -> str:
  """The lock file of a process: `lock` for the chief (and a run of one
  process), `lock.worker-1` for worker 1 of a multi-worker run, so that
  every process of a second run on the workdir is refused."""
  return (LOCK_FILE if is_chief or task_type is None
          else f"{LOCK_FILE}.{task_type}-{task_index}")


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
  for name in (FLAGS_FILE, SUMMARY_FILE, INDEX_FILE):
    _expect_kind(os.path.join(root, name), is_dir=False)
  for name in (CHECKPOINT_DIR, *dirs):
    _expect_kind(os.path.join(root, name), is_dir=True)
  _check_flags(config)


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
      raise UserError(f"--workdir={root} is not writable by this user; use "
                      "another --workdir")
    return
  parent = os.path.dirname(path)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise UserError(f"--workdir={root} cannot be created: {parent} is a "
                    "file; use another --workdir")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise UserError(f"--workdir={root} cannot be created: {parent} is not "
                    "writable; use another --workdir")


def _expect_kind(path: str, is_dir: bool) -> None:
  if not os.path.lexists(path) or os.path.isdir(path) == is_dir:
    return
  what, should = (("a file", "a directory") if is_dir
                  else ("a directory", "a file"))
  raise UserError(f"{path} is {what}, but a run keeps {should} there; move "
                  "it aside (nothing was changed)")


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


def _check_flags(config: Config) -> None:
  """flags.txt is a flagfile with the same layout flags as `config`."""
  path = os.path.join(config.workdir, FLAGS_FILE)
  if config.allow_config_change or not os.path.exists(path):
    return
  changes = config.layout_changes(read_flags(path))
  if changes:
    raise UserError(
        f"{config.workdir} holds a run with other settings "
        f"({'; '.join(changes)}). Use a new --workdir, restore the old values, "
        "or pass --allow_config_change to resume anyway")


# -- the lock --


class Lock:
  """An exclusive lock on a workdir, held while the run is alive.

  Use as a context manager, or `acquire()` and `release()`.

  Args:
    workdir: the run's directory; created if it does not exist (and
      removed at release if it is still empty then).
    name: the lock file's name in it (`lock_name`).
  """

  def __init__(self, workdir: str, name: str = LOCK_FILE):
    self.workdir = workdir
    self.path = os.path.join(workdir, name)
    self._fd: Optional[int] = None
    self._created: List[str] = []

  def __enter__(self) -> "Lock":
    self.acquire()
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()

  def acquire(self) -> None:
    """Takes the lock, or fails at once.

    Raises:
      UserError: another process holds it (named by PID), or the workdir
        cannot be created.
    """
    for _ in range(_OPEN_TRIES):
      self._make_workdir()
      fd = self._open()
      if fd is None:
        continue  # Another process of the run removed the empty workdir.
      self._lock(fd)
      if _same_file(fd, self.path):
        self._fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return
      os.close(fd)  # Its holder removed it as we opened it: lock the new one.
    self._remove_created()
    raise UserError(f"cannot lock --workdir={self.workdir}: {self.path} "
                    "keeps disappearing; is another program cleaning it?")

  def _open(self) -> Optional[int]:
    """The lock file, open; None if the workdir vanished."""
    try:
      return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
      return None
    except OSError as e:
      self._remove_created()
      raise UserError(f"cannot lock --workdir={self.workdir}: {self.path}: "
                      f"{e.strerror}") from None

  def _lock(self, fd: int) -> None:
    """flock, without waiting; closes `fd` and raises if it fails."""
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _read_pid(fd) if isinstance(e, BlockingIOError) else None
      os.close(fd)
      self._remove_created()
      if isinstance(e, BlockingIOError):
        raise UserError(
            f"--workdir={self.workdir} is in use by another run (pid "
            f"{holder or 'unknown'}, lock {self.path}); wait for it to end, "
            "stop it, or use another --workdir") from None
      raise UserError(f"cannot lock {self.path} ({e.strerror}); use a "
                      "workdir on a local filesystem") from None

  def release(self) -> None:
    """Removes the lock file, then unlocks. Safe to call twice."""
    if self._fd is None:
      return
    try:
      os.unlink(self.path)  # Still locked: see `_same_file`.
    except OSError:
      pass
    os.close(self._fd)
    self._fd = None
    self._remove_created()

  def _make_workdir(self) -> None:
    """Creates the workdir and any missing parent, remembering which."""
    missing = []
    path = os.path.abspath(self.workdir)
    while not os.path.isdir(path):
      missing.append(path)
      path = os.path.dirname(path)
    for path in reversed(missing):
      try:
        os.mkdir(path)
        self._created.append(path)
      except FileExistsError:
        pass
      except OSError as e:
        self._remove_created()
        raise UserError(f"cannot create --workdir={self.workdir}: {path}: "
                        f"{e.strerror}; use another --workdir") from None

  def _remove_created(self) -> None:
    """Removes the directories this lock created, if they are still empty:
    a run that failed before writing leaves no workdir behind."""
    while self._created:
      try:
        os.rmdir(self._created.pop())
      except OSError:
        self._created.clear()  # Not empty: the run wrote something.


def _same_file(fd: int, path: str) -> bool:
  """Whether `path` still names the file open as `fd`. A holder removes its
  lock file before it unlocks; a process that opened the old file in that
  window must not count the lock it then gets."""
  try:
    st = os.stat(path)
  except FileNotFoundError:
    return False
  mine = os.fstat(fd)
  return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_pid(fd: int) -> Optional[int]:
  """The PID a lock's holder wrote in it, if it did already."""
  for _ in range(_PID_READ_TRIES):
    try:
      text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
      return None
    if text.isdigit():
      return int(text)
    time.sleep(0.01)
  return None
