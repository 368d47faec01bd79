"""Crash-safe writes of the small files a run leaves in its workdir."""

import json
import os
import tempfile


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
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def atomic_write_json(path: str, data) -> None:
  atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
