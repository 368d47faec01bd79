"""The workdir's lock: one run at a time, and no trace of a refused one.

A run owns its workdir through an exclusive OS lock, `fcntl.flock` on
WORKDIR/lock (WORKDIR/lock.worker-1 etc. for the other processes of a
multi-worker run), which the kernel releases when the process ends, however
it ends. A second run on the same workdir fails at once, naming the PID that
holds it. The holder writes its PID into the lock file and removes the file
while it still holds the lock; a process that opened the old file in that
moment finds the path now names another file, or none, and tries again, so
two processes never both hold the lock.

The lock creates the workdir if needed and removes it again, with the lock
file, if the run ends before writing anything in it: a refused run, even
one refused because the disk is full, leaves no new directory behind. This
module does not import TensorFlow, so a tool can take or test the lock
cheaply.
"""

import errno
import fcntl
import os
import time
from typing import List, Optional

from dist_loop.core.errors import UserError
from dist_loop.runtime.checkpoint_names import newest_checkpoint_note

LOCK_FILE = "lock"
# What to do about a lock file that cannot be written, by the error's cause.
_FIXES = {
    errno.ENOSPC: "Free some space",
    errno.EDQUOT: "Free some space (the disk quota is used up)",
    errno.EACCES: "Fix the workdir's permissions",
    errno.EPERM: "Fix the workdir's permissions",
    errno.EROFS: "Use a workdir on a filesystem mounted read-write",
}
_PID_READ_TRIES = 20  # The holder writes its PID just after it locks.
_OPEN_TRIES = 5


def lock_name(task_type: Optional[str], task_index: int,
              is_chief: bool) -> str:
  """The lock file of a process: `lock` for the chief (and a run of one
  process), `lock.worker-1` for worker 1 of a multi-worker run, so that
  every process of a second run on the workdir is refused."""
  return (LOCK_FILE if is_chief or task_type is None
          else f"{LOCK_FILE}.{task_type}-{task_index}")


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
      if os.path.islink(self.workdir) and not os.path.exists(self.workdir):
        self._remove_created()
        raise UserError(f"cannot lock --workdir={self.workdir}: it is a "
                        "symbolic link to nothing; create its target, or "
                        "remove the link")
      fd = self._open()
      if fd is None:
        continue  # Another process of the run removed the empty workdir.
      self._lock(fd)
      if _same_file(fd, self.path):
        self._fd = fd
        self._write_pid()
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
    except IsADirectoryError:
      self._remove_created()
      raise UserError(f"{self.path} is a directory, but a run keeps its lock "
                      "file there; move it aside (nothing was changed)"
                      ) from None
    except OSError as e:
      self._remove_created()
      raise self._unwritable("create the lock file", e) from None

  def _write_pid(self) -> None:
    """Writes this process's PID into the held lock file, for a second run
    to name; if it cannot (a full disk), lets the lock go as `release`
    does, so that a refused run leaves no lock file and no new workdir."""
    try:
      os.ftruncate(self._fd, 0)
      os.write(self._fd, f"{os.getpid()}\n".encode())
    except OSError as e:
      self.release()
      raise self._unwritable("write this run's PID into the lock file",
                             e) from None

  def _unwritable(self, what: str, error: OSError) -> UserError:
    fix = _FIXES.get(error.errno, "Fix what the error names")
    return UserError(
        f"cannot {what} {self.path} ({error.strerror}); nothing was written, "
        f"and {newest_checkpoint_note(self.workdir)}. {fix}, then rerun the "
        "same command")

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
