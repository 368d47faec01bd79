"""Crash-safe writes of the small files a run leaves in its workdir.

A write goes to a temporary file in the same directory, is flushed to disk,
and replaces the target in one rename; the directory is then synced so the
rename itself survives a power cut. A failure (a full disk, a directory in
the target's place) raises `OSError` with the old file intact and no
temporary file left.

An append-only record (goodput's, the launcher's) is JSON lines instead:
`append_json_line` adds one line in one write, so a crash leaves at most a
last line cut short, which `complete_lines` leaves out.

`reason` is what a one-line error says about any failed write, ours or
TensorFlow's (a checkpoint, an events file): the operating system's words,
"No space left on device", without the op and device names around them.
"""

import json
import os
import re
import tempfile
from typing import List, Tuple


def atomic_write_text(path: str, text: str) -> None:
  """Writes `text` so that readers see the old file or the new, never half."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_directory(directory)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _sync_directory(directory: str) -> None:
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  except OSError:
    pass  # Not every filesystem syncs directories; the rename is done.
  finally:
    os.close(fd)


def atomic_write_json(path: str, data) -> None:
  atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def append_json_line(path: str, record) -> None:
  """Appends `record` as one JSON line, in one write to a file opened for
  appending. Raises OSError."""
  line = json.dumps(record, sort_keys=True) + "\n"
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    os.write(fd, line.encode("utf-8"))
  finally:
    os.close(fd)


def complete_lines(path: str) -> List[Tuple[int, bytes]]:
  """The non-blank lines of an append-only file as (line number, line),
  without a last line cut short (no newline: a crash mid-write). Raises
  OSError."""
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  del lines[-1]  # Empty after a final newline; else cut short.
  return [(n, line) for n, line in enumerate(lines, 1) if line.strip()]


def reason(error: BaseException) -> str:
  """Why a write failed, in a few words, from an `OSError` or a TensorFlow
  I/O error (whose first line is "{{function_node ...}} PATH; No space
  left on device [Op:SaveV2]")."""
  if isinstance(error, OSError) and error.strerror:
    return error.strerror
  text = str(getattr(error, "message", None) or error).strip()
  line = text.splitlines()[0] if text else type(error).__name__
  line = re.sub(r"\s*\[Op:[^\]]*\].*$", "", line)
  return line.rsplit("; ", 1)[-1].strip()[:200] or type(error).__name__
