"""Checkpoints: one object graph for every mode, written by the chief.

The checkpoint holds `step`, `model` and `optimizer` (and `loss_scale` under
float16; see `Trainer.checkpoint_items`), and the input's own state where
it has one (`bad_records` with --skip_bad_records: `data.checkpoint_items`),
an optional item that a checkpoint without it leaves as it is, so older
checkpoints and other runs' still restore. Every mode builds the same
`keras.Sequential` and one optimizer over all its variables, so a checkpoint
written by one mode restores in another. `tf.train.CheckpointManager` writes
each checkpoint under a new name and only then points the index file
(`checkpoint`) at it, so a crash mid-write leaves the previous checkpoint as
the latest.

A save that fails (a full disk) removes what it wrote of the new checkpoint
(TensorFlow leaves a `ckpt-N_temp` directory and partial `ckpt-N.*` files)
and ends the run with one line naming the newest good checkpoint. Which
checkpoint a run resumes from is `resume.py`'s.

With `--async_checkpoint` a save copies the variables to host memory (so
training may change them) and TensorFlow's thread writes the files
(`CheckpointOptions(enable_async=True)`); the manager points the index at
the checkpoint only from that thread, once its files are complete, so a
crash mid-write still leaves the previous checkpoint as the latest. At most
one save is in flight: the next save, a restore (a rollback), the end of
the run and a stop first `wait` for it, bounded by `ASYNC_WAIT_S`, and a
failed background write is then handled as a failed save (its files
removed, one line). The host copy doubles the memory of the checkpointed
state.
"""

import collections
import os
import threading
import time
from typing import Dict, Optional, Sequence, Set

import tensorflow as tf
from absl import logging

from dist_loop.core.errors import UserError
from dist_loop.runtime import resume
from dist_loop.runtime import strategy as strategy_lib
from dist_loop.runtime.checkpoint_names import CHECKPOINT_DIR, CHECKPOINT_PREFIX
from dist_loop.runtime.checkpoint_names import newest_checkpoint_note
from dist_loop.runtime.checkpoint_names import scan_checkpoints
from dist_loop.runtime.files import reason

# The longest wait for a background save: far beyond any save of a model
# that fits one machine's memory, and a hung filesystem ends in one line.
ASYNC_WAIT_S = 1800.0


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
    async_save: write in the background (`--async_checkpoint`).
    fresh: items not restored until the first save (the optimizer, after
      an allowed change of --optimizer: its slots start fresh).
    optional: items restored from the checkpoints that hold them and left
      as they are by those that do not (the input's count of bad records,
      which older checkpoints and other runs' lack).
  """

  def __init__(self, items: Dict[str, object], workdir: str, max_to_keep: int,
               is_chief: bool = True, task_index: int = 0,
               async_save: bool = False, fresh: Sequence[str] = (),
               optional: Sequence[str] = ()):
    self.items = dict(items)
    self.fresh = tuple(fresh)
    self.optional = tuple(optional)
    self.workdir = workdir
    self.manager = manager(items, workdir, max_to_keep, is_chief, task_index)
    self._options = None
    if async_save:
      _host_copies_of_keras_variables()
      self._options = tf.train.CheckpointOptions(enable_async=True)
    # The newest good checkpoint this process knows: restored or saved.
    self._latest: Optional[str] = None
    # The background save in flight: (step, path, the directory before it).
    self._pending = None

  @property
  def saved_step(self) -> Optional[int]:
    """The step of the latest checkpoint (or of the one being written), or
    None before the first."""
    if self._pending is not None:
      return self._pending[0]
    latest = self._latest or self.manager.latest_checkpoint
    return None if latest is None else int(latest.rsplit("-", 1)[-1])

  def save(self, step: int) -> Optional[str]:
    """Saves the state at `step` (in the background with `async_save`,
    after waiting for the previous save); returns the path, or None if the
    latest checkpoint already is of `step` (the state is the same).

    Raises:
      UserError: the checkpoint (or the previous one in the background)
        could not be written (a full disk); what was written of it is
        removed, and the message names the newest good checkpoint.
    """
    if self.saved_step == step:
      return None
    self.wait()
    before = _listing(self.manager.directory)
    try:
      path = self.manager.save(checkpoint_number=step, options=self._options)
    except strategy_lib.LOST_TASK_ERRORS:
      raise  # A lost peer: `train.run` has the mode explain it.
    except (tf.errors.OpError, OSError) as e:
      raise self._failed(step, e) from None
    self.fresh = ()  # Its checkpoints hold the new items.
    if self._options is not None:
      self._pending = (step, path, before)
      return path
    # Off the chief, the chief's copy: the worker's own is deleted.
    self._latest = self.manager.latest_checkpoint or path
    logging.info("step %d  saved checkpoint %s", step, path)
    return path

  def wait(self) -> None:
    """Returns once no save is in flight (at most `ASYNC_WAIT_S`).

    Raises:
      UserError: the background save failed, or did not end in time; what
        it wrote is removed (when it failed).
    """
    if self._pending is None:
      return
    step, path, before = self._pending
    self._pending = None
    error = _sync(self.manager)
    if isinstance(error, TimeoutError):
      raise UserError(
          f"the checkpoint of step {step} was not written within "
          f"{ASYNC_WAIT_S:.0f} s (is {self.manager.directory} on a hung "
          f"filesystem?); {self._newest_note()}. Rerun the same command to "
          "resume from there")
    committed = self.manager.latest_checkpoint == path
    if error is None and not committed and isinstance(self.manager,
                                                      _Manager):
      error = OSError("the index does not name it")
    if error is not None:
      _remove_new(self.manager.directory, before, os.path.basename(path))
      if isinstance(error, strategy_lib.LOST_TASK_ERRORS):
        raise error
      raise self._failed(step, error)
    self._latest = self.manager.latest_checkpoint or path
    logging.info("step %d  saved checkpoint %s", step, path)

  def close(self) -> None:
    """Waits for a save in flight as a run ends early: a failure (a full
    disk, a lost peer) is a warning, since the error that ends the run
    stands."""
    try:
      self.wait()
    except (UserError, tf.errors.OpError) as e:
      logging.warning("%s", e)

  def restore(self, scope) -> Optional[str]:
    """See `resume.restore_latest`; first waits for a save in flight (a
    rollback may come right after one)."""
    self.wait()
    checkpoint = None
    if self.fresh:
      checkpoint = tf.train.Checkpoint(**{
          k: v for k, v in self.items.items() if k not in self.fresh})
    path = resume.restore_latest(self.manager, scope, self.items,
                                 self.workdir, checkpoint,
                                 optional=self.optional)
    self._latest = path or self._latest
    return path

  def _failed(self, step: int, error: Exception) -> UserError:
    return UserError(
        f"cannot write the checkpoint of step {step} in "
        f"{self.manager.directory} ({reason(error)}); what was written of "
        f"it is removed, and {self._newest_note()}. Free some space (or fix "
        "the directory's permissions), then rerun the same command to "
        "resume from there")

  def _newest_note(self) -> str:
    if self._latest is None:
      return newest_checkpoint_note(self.workdir)
    return f"the newest checkpoint, {self._latest}, is intact"


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
  cannot be read, instead of raising, and whose failed save leaves nothing.

  Without history it knows none of the older checkpoints, so it never
  deletes them; `restore_latest` finds them by their names. Its first save
  rewrites the index.
  """

  def __init__(self, checkpoint, directory, max_to_keep):
    try:
      super().__init__(checkpoint, directory, max_to_keep=max_to_keep)
    except ValueError:  # Empty, or not text (UnicodeDecodeError).
      # The state TensorFlow's constructor sets when there is no index.
      self._maybe_delete = collections.OrderedDict()
      self._latest_checkpoint = None
      self._last_preserved_timestamp = time.time() - 1.0

  def save(self, checkpoint_number: int, options=None) -> str:  # pylint: disable=arguments-differ
    """Saves; if that fails, removes the new checkpoint's files (TensorFlow
    leaves `ckpt-N_temp/` and partial `ckpt-N.*`, and an index's temporary
    file) and forgets it, then raises. Returns the path."""
    name = f"{CHECKPOINT_PREFIX}-{checkpoint_number}"
    before = _listing(self.directory)
    state = (self._latest_checkpoint, collections.OrderedDict(
        self._maybe_delete))
    try:
      return super().save(checkpoint_number=checkpoint_number,
                          options=options)
    except BaseException:
      path = os.path.join(self.directory, name)
      if _indexed(self.directory) == path:
        # The index already names it: only the bookkeeping after it failed.
        logging.warning("Saved %s, but could not update the index's list of "
                        "older checkpoints.", path)
        return path
      self._latest_checkpoint, self._maybe_delete = state
      _remove_new(self.directory, before, name)
      raise


def _host_copies_of_keras_variables() -> None:
  """Lets TensorFlow's background save copy a Keras variable to the host.

  Keras 3's `Variable._copy_trackable_to_cpu` makes a new `tf.Variable` from
  the host copy at every save: inside TensorFlow's traced copy that is an
  error from the second save on, and the value it would save is the first
  save's. The host copy of the variable it wraps (TensorFlow's, updated at
  every save) is the copy.
  """
  from keras.src.backend.tensorflow import core  # pylint: disable=g-import-not-at-top

  def copy(variable, object_map):
    variable.value._copy_trackable_to_cpu(object_map)  # pylint: disable=protected-access
    object_map[variable] = object_map[variable.value]

  core.Variable._copy_trackable_to_cpu = copy  # pylint: disable=protected-access


def _listing(directory: str) -> Set[str]:
  return set(os.listdir(directory)) if os.path.isdir(directory) else set()


def _sync(mgr) -> Optional[BaseException]:
  """Waits for `mgr`'s background save, from a thread so that the wait is
  bounded; returns what the save raised, a `TimeoutError`, or None."""
  checkpoint = mgr.checkpoint
  outcome = []

  def wait():
    try:
      mgr.sync()
      helper = getattr(checkpoint, "_async_checkpointer_impl", None)
      if helper is not None:  # TensorFlow keeps the thread's error there.
        helper._check_async_thread_error()  # pylint: disable=protected-access
    except BaseException as e:  # pylint: disable=broad-except
      outcome.append(e)
    else:
      outcome.append(None)

  thread = threading.Thread(target=wait, name="checkpoint-wait", daemon=True)
  thread.start()
  thread.join(ASYNC_WAIT_S)
  return outcome[0] if outcome else TimeoutError()


def _remove_new(directory: str, before, name: str) -> None:
  """Removes what a failed save of checkpoint `name` added to `directory`."""
  for entry in set(os.listdir(directory)) - before:
    if (entry == f"{name}_temp" or entry.startswith(f"{name}.")
        or entry.startswith("checkpoint.tmp")):
      path = os.path.join(directory, entry)
      try:
        if os.path.isdir(path):
          tf.io.gfile.rmtree(path)
        else:
          os.unlink(path)
      except (OSError, tf.errors.OpError) as e:
        logging.warning("Could not remove %s (%s).", path, reason(e))


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

  def save(self, checkpoint_number: int, options=None) -> str:
    """Saves to the temporary directory and deletes it, or (a background
    save) deletes it in `sync`, once the files are written."""
    temp = tf.train.CheckpointManager(self.checkpoint, self._temp_directory,
                                      max_to_keep=1)
    try:
      path = temp.save(checkpoint_number=checkpoint_number, options=options)
    except BaseException:
      self._remove_temp()
      raise
    if options is None:
      self._remove_temp()
    self._latest = os.path.join(self._chief_directory, os.path.basename(path))
    return path

  def sync(self) -> None:
    """Waits for a background save, then deletes its files."""
    try:
      self.checkpoint.sync()
    finally:
      self._remove_temp()

  def _remove_temp(self) -> None:
    if tf.io.gfile.exists(self._temp_directory):
      tf.io.gfile.rmtree(self._temp_directory)


def latest(directory: str) -> Optional[str]:
  """The newest checkpoint of `directory`: the one its index names, else
  the newest `ckpt-N` found by name; None if there is none."""
  return _indexed(directory) or (scan_checkpoints(directory) or [None])[-1]


def _indexed(directory: str) -> Optional[str]:
  """The latest checkpoint the index names; None if it names none or
  cannot be read."""
  try:
    return tf.train.latest_checkpoint(directory)
  except ValueError:  # Empty, or not text (UnicodeDecodeError).
    return None
