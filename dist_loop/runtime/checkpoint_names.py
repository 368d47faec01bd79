"""Checkpoints by their names, without TensorFlow.

Checkpoint N of a run is WORKDIR/checkpoints/ckpt-N.index and its data
files; TensorFlow's index file, WORKDIR/checkpoints/checkpoint, names the
latest. Code that must not import TensorFlow (the workdir's lock, the
messages of a failed write) and the restore's fallback (`resume.py`, when
the index is unreadable or names checkpoints that are gone) find them here.
"""

import glob
import os
import re
from typing import List

CHECKPOINT_DIR = "checkpoints"
INDEX_FILE = os.path.join(CHECKPOINT_DIR, "checkpoint")  # TensorFlow's.
CHECKPOINT_PREFIX = "ckpt"


def scan_checkpoints(directory: str) -> List[str]:
  """The `ckpt-N` checkpoints in `directory` by their files, oldest first."""
  steps = []
  for index in glob.glob(os.path.join(glob.escape(directory),
                                      f"{CHECKPOINT_PREFIX}-*.index")):
    match = re.fullmatch(rf"{CHECKPOINT_PREFIX}-(\d+)\.index",
                         os.path.basename(index))
    if match:
      steps.append(int(match.group(1)))
  return [os.path.join(directory, f"{CHECKPOINT_PREFIX}-{n}")
          for n in sorted(steps)]


def newest_checkpoint_note(workdir: str) -> str:
  """What the message of a failed write says is safe: the checkpoint a rerun
  resumes from (the one the index names while its files are there, else the
  newest `ckpt-N`), or that there is none yet."""
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  newest = None
  try:
    with open(os.path.join(workdir, INDEX_FILE), encoding="utf-8") as f:
      match = re.search(r'^model_checkpoint_path: "(.+)"$', f.read(), re.M)
    named = match and os.path.join(directory, match.group(1))
    if named and os.path.exists(named + ".index"):
      newest = named
  except (OSError, UnicodeDecodeError):
    pass  # Missing or damaged: the names tell.
  newest = newest or (scan_checkpoints(directory) or [None])[-1]
  if newest is None:
    return "there is no checkpoint yet"
  return f"the newest checkpoint, {newest}, is intact"
