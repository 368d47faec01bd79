"""Checkpoints: one object graph for every mode, written by the chief.

The checkpoint holds `step`, `model` and `optimizer` (and `loss_scale` under
float16; see `Trainer.checkpoint_items`). Every mode builds the same
`keras.Sequential` and one optimizer over all its variables, so a checkpoint
written by one mode restores in another. `tf.train.CheckpointManager` writes
each checkpoint under a new name and only then points the index file
(`checkpoint`) at it, so a crash mid-write leaves the previous checkpoint as
the latest. If the index itself cannot be read (empty, garbage, missing),
the `ckpt-*` files are tried, newest first, with a warning.
"""

import collections
import glob
import os
import re
import time
from typing import Dict, List, Optional

import tensorflow as tf
from absl import logging

from dist_loop import data, models
from dist_loop import strategy as strategy_lib
from dist_loop.errors import UserError
from dist_loop.workdir import CHECKPOINT_DIR

PREFIX = "ckpt"


class Checkpointer:
  """The run's checkpoints, as the controller uses them: save at a step,
  restore the newest readable one.

  Args:
    items: what the checkpoint holds (`Trainer.checkpoint_items()`).
    workdir: the run's directory; checkpoints go to WORKDIR/checkpoints.
    max_to_keep: checkpoints kept on the chief.
    is_chief: whether this process keeps its checkpoints.
    task_index: this process's index in its job (names a non-chief's
      temporary directory).
  """

  def __init__(self, items: Dict[str, object], workdir: str, max_to_keep: int,
               is_chief: bool = True, task_index: int = 0):
    self.manager = manager(items, workdir, max_to_keep, is_chief, task_index)
    self._restored: Optional[str] = None

  @property
  def saved_step(self) -> Optional[int]:
    """The step of the latest checkpoint, or None before the first."""
    latest = self.manager.latest_checkpoint or self._restored
    return None if latest is None else int(latest.rsplit("-", 1)[-1])

  def save(self, step: int) -> Optional[str]:
    """Saves the state at `step`; returns the path, or None if the latest
    checkpoint already is of `step` (the state is the same)."""
    if self.saved_step == step:
      return None
    path = self.manager.save(checkpoint_number=step)
    logging.info("step %d  saved checkpoint %s", step, path)
    return path

  def restore(self, scope) -> Optional[str]:
    """See `restore_latest`."""
    path = restore_latest(self.manager, scope)
    self._restored = path or self._restored
    return path


def manager(items, workdir: str, max_to_keep: int, is_chief: bool = True,
            task_index: int = 0):
  """A CheckpointManager over `items` in WORKDIR/checkpoints.

  Off the chief (multi-worker sync), a `WorkerTempManager`: every worker of a
  MultiWorkerMirroredStrategy must take part in a save, but only the chief's
  copy is kept. `task_index` names that worker's temporary directory.
  """
  checkpoint = tf.train.Checkpoint(**items)
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  if not is_chief:
    return WorkerTempManager(checkpoint, directory, task_index)
  return _Manager(checkpoint, directory, max_to_keep=max_to_keep)


class _Manager(tf.train.CheckpointManager):
  """A CheckpointManager that starts without history when the index file
  cannot be read, instead of raising.

  It then knows none of the older checkpoints, so it never deletes them;
  `restore_latest` finds them by their names. Its first save rewrites the
  index.
  """

  def __init__(self, checkpoint, directory, max_to_keep):
    try:
      super().__init__(checkpoint, directory, max_to_keep=max_to_keep)
    except ValueError:  # Empty, or not text (UnicodeDecodeError).
      # The state TensorFlow's constructor sets when there is no index.
      self._maybe_delete = collections.OrderedDict()
      self._latest_checkpoint = None
      self._last_preserved_timestamp = time.time() - 1.0


class WorkerTempManager:
  """A non-chief worker's checkpoints: written to a temporary directory of
  its own, deleted straight away (the MWMS recipe: saving may run collectives
  every worker has to join, and two writers must not share a path).

  `latest_checkpoint` names the chief's copy of what this worker last saved,
  or before any save the chief's latest, which restore reads: the workdir is
  on a filesystem every worker sees.
  """

  def __init__(self, checkpoint: tf.train.Checkpoint, chief_directory: str,
               task_index: int):
    self.checkpoint = checkpoint
    self._chief_directory = chief_directory
    self._temp_directory = os.path.join(chief_directory,
                                        f"workertemp_{task_index}")
    self._latest = _indexed(chief_directory)

  @property
  def latest_checkpoint(self):
    return self._latest

  @property
  def directory(self):
    """Where the run's checkpoints are kept: the chief's directory."""
    return self._chief_directory

  def save(self, checkpoint_number: int) -> str:
    temp = tf.train.CheckpointManager(self.checkpoint, self._temp_directory,
                                      max_to_keep=1)
    path = temp.save(checkpoint_number=checkpoint_number)
    tf.io.gfile.rmtree(self._temp_directory)
    self._latest = os.path.join(self._chief_directory, os.path.basename(path))
    return path


def restore_latest(mgr, scope):
  """Restores the newest readable checkpoint under `scope`.

  A checkpoint that fails to read (a truncated or missing file) is skipped
  with a warning, and the one before it is tried: a crash or a full disk
  costs one checkpoint interval, never the run.

  Returns:
    The path restored, or None if the directory holds no checkpoint.

  Raises:
    UserError: checkpoints exist but none can be read.
    tf.errors.OpError: a lost peer or parameter server
      (`strategy.LOST_TASK_ERRORS`), which every older checkpoint would hit
      too; `train.run` has the mode's `cluster_error` explain it.
  """
  candidates = _candidates(mgr)
  if not candidates:
    return None
  failures = []
  with scope:
    path = _restore_first_readable(mgr.checkpoint, reversed(candidates),
                                   failures)
  if path is not None:
    logging.info("Resumed from %s.", path)
    return path
  raise UserError(
      f"no readable checkpoint in {os.path.dirname(candidates[-1])} (tried "
      f"{', '.join(os.path.basename(p) for p in failures)}); move that "
      "directory aside to start the run over")


def _restore_first_readable(checkpoint, paths, failures):
  for path in paths:
    try:
      checkpoint.restore(path).assert_existing_objects_matched()
    except strategy_lib.LOST_TASK_ERRORS:
      raise  # Not this file's fault: an older one would fail the same way.
    except (tf.errors.OpError, ValueError, AssertionError, IndexError,
            KeyError) as e:  # What truncated or missing files raise.
      first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
      logging.warning("Checkpoint %s is unreadable (%s: %s); trying the one "
                      "before it.", path, type(e).__name__, first_line[:200])
      failures.append(path)
      continue
    return path
  return None


def _candidates(mgr) -> List[str]:
  """Checkpoint paths, oldest first: the manager's list and its latest; or,
  if the index named none, every `ckpt-N` in the directory."""
  listed = list(getattr(mgr, "checkpoints", None) or [])
  latest = mgr.latest_checkpoint
  if latest and latest not in listed:
    listed.append(latest)
  if listed:
    return listed
  directory = mgr.directory
  found = scan(directory)
  if found:
    logging.warning(
        "The checkpoint index %s is missing or unreadable; trying the "
        "checkpoints it should list, newest first: %s.",
        os.path.join(directory, "checkpoint"),
        ", ".join(os.path.basename(p) for p in reversed(found)))
  return found


def scan(directory: str) -> List[str]:
  """The `ckpt-N` checkpoints in `directory` by their files, oldest first."""
  steps = []
  for index in glob.glob(os.path.join(glob.escape(directory),
                                      f"{PREFIX}-*.index")):
    match = re.fullmatch(rf"{PREFIX}-(\d+)\.index", os.path.basename(index))
    if match:
      steps.append(int(match.group(1)))
  return [os.path.join(directory, f"{PREFIX}-{n}") for n in sorted(steps)]


def _indexed(directory: str) -> Optional[str]:
  """The latest checkpoint the index names; None if it names none or
  cannot be read."""
  try:
    return tf.train.latest_checkpoint(directory)
  except ValueError:  # Empty, or not text (UnicodeDecodeError).
    return None


def load_model(config, path: Optional[str] = None):
  """The run's model with the variables of its latest checkpoint (or `path`).

  For evaluation, fine-tuning and tests: no strategy, no optimizer, float32.

  Raises:
    FileNotFoundError: the workdir holds no checkpoint.
  """
  dataset = data.load(config)
  model = models.build(config.model, dataset.input_shape,
                       dataset.num_classes, options=config.model_options)
  directory = os.path.join(config.workdir, CHECKPOINT_DIR)
  path = path or _indexed(directory) or (scan(directory) or [None])[-1]
  if path is None:
    raise FileNotFoundError(f"no checkpoint in {config.workdir}")
  tf.train.Checkpoint(model=model).restore(path).expect_partial()
  return model
