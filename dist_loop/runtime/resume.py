"""The checkpoint a run resumes from: the newest that can be read and fits.

The candidates are the checkpoints the index (`checkpoints/checkpoint`)
names, newest first, then every other `ckpt-N` of the directory, newest
first: the index may be unreadable, or name only checkpoints that are gone
(`ckpt-999` with `ckpt-50` and `ckpt-100` intact still resumes at 100).

A candidate whose restore fails is read once more, tensor by tensor, to
tell two failures apart:

* unreadable (truncated, missing): skipped with a warning, and the one
  before it is tried. A crash or a full disk costs a checkpoint interval.
* readable but incompatible (written by another mode, model, optimizer or
  precision): the run stops, naming what differs. Falling back past it would
  silently drop the training it holds, and no advice here ever suggests
  discarding a checkpoint that can be read.
"""

import os
import re
from typing import Dict, Optional, Sequence, Set

import tensorflow as tf
from absl import logging
from google.protobuf import message
from tensorflow.core.protobuf import trackable_object_graph_pb2

from dist_loop.core.errors import UserError
from dist_loop.runtime import strategy as strategy_lib
from dist_loop.runtime.checkpoint_names import scan_checkpoints
from dist_loop.runtime.workdir import FLAGS_FILE

_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
# What reading a truncated, missing or foreign checkpoint raises.
_READ_ERRORS = (tf.errors.OpError, ValueError, AssertionError, IndexError,
                KeyError)


def restore_latest(mgr, scope, items: Optional[Dict[str, object]] = None,
                   workdir: Optional[str] = None, checkpoint=None,
                   optional: Sequence[str] = ()):
  """Restores the newest readable checkpoint under `scope`.

  The candidates are the checkpoints the index names, newest first, then
  the other `ckpt-N` files of the directory, newest first. One that fails
  to read (a truncated or missing file) is skipped with a warning, and the
  next is tried: a crash or a full disk costs one checkpoint interval,
  never the run.

  Args:
    mgr: the run's manager (`checkpoints.manager`).
    scope: the strategy scope to restore under.
    items: what the checkpoint should hold, to say what differs when it
      does not fit.
    workdir: the run's directory, to name its flags.txt in that message.
    checkpoint: what to restore into (default `mgr.checkpoint`): a part
      of it, whose other saved values are then not expected.
    optional: names of `items` that a checkpoint need not hold: restored
      from one that does, left as they are by one that does not (an older
      checkpoint, or one of a run without them).

  Returns:
    The path restored, or None if the directory holds no checkpoint.

  Raises:
    UserError: checkpoints exist but none can be read; or the newest
      readable one does not fit this run (another mode or model).
    tf.errors.OpError: a lost peer or parameter server
      (`strategy.LOST_TASK_ERRORS`), which every older checkpoint would hit
      too; `train.run` has the mode's `cluster_error` explain it.
  """
  listed, others = _candidates(mgr)
  if not listed and not others:
    return None
  failures = []
  partial = checkpoint is not None
  checkpoint = checkpoint or mgr.checkpoint
  target = _Target(checkpoint, partial, items, optional)
  with scope:
    path = _restore_first_readable(target, listed, failures, workdir)
    if path is None and others:
      index = os.path.join(mgr.directory, "checkpoint")
      logging.warning(
          "%s; trying %s, newest first: %s.",
          f"None of the checkpoints the index {index} names can be read"
          if listed else f"The checkpoint index {index} is missing or "
          "unreadable", "the other checkpoints" if listed else
          "the checkpoints it should list",
          ", ".join(os.path.basename(p) for p in others))
      path = _restore_first_readable(target, others, failures, workdir)
  if path is not None:
    logging.info("Resumed from %s.", path)
    return path
  raise UserError(
      f"no readable checkpoint in {mgr.directory} (tried "
      f"{', '.join(os.path.basename(p) for p in failures)}: each is "
      "truncated or missing); move that directory aside to start the run "
      "over")


class _Target:
  """What a checkpoint is restored into: `checkpoint` (`partial`: a part
  of the run's), less the `optional` items the checkpoint does not hold."""

  def __init__(self, checkpoint, partial: bool, items, optional):
    self.checkpoint, self.partial = checkpoint, partial
    self.items, self.optional = items or {}, tuple(optional)

  def for_path(self, path: str):
    """(what to restore `path` into, whether that is a part of it)."""
    missing = set(self.optional) - _saved_items(path) if self.optional else ()
    if not missing:
      return self.checkpoint, self.partial
    kept = {name: getattr(self.checkpoint, name) for name in self.items
            if name not in missing and hasattr(self.checkpoint, name)}
    return tf.train.Checkpoint(**kept), True


def _restore_first_readable(target, paths, failures, workdir):
  for path in paths:
    status = None
    try:
      checkpoint, partial = target.for_path(path)
      status = checkpoint.restore(path)
      status.assert_existing_objects_matched()
      if partial:
        status.expect_partial()
    except strategy_lib.LOST_TASK_ERRORS:
      raise  # Not this file's fault: an older one would fail the same way.
    except _READ_ERRORS as e:
      if status is not None:
        status.expect_partial()  # Its values are not wanted: no warnings.
      if _readable(path):
        needed = {k: v for k, v in target.items.items()
                  if k not in target.optional}
        raise _incompatible(path, e, needed, workdir) from None
      logging.warning("Checkpoint %s is unreadable (%s: %s); trying the one "
                      "before it.", path, type(e).__name__, _first_line(e))
      failures.append(path)
      continue
    return path
  return None


def _candidates(mgr):
  """(the checkpoints the index names, the other `ckpt-N` files), each
  newest first."""
  listed = list(getattr(mgr, "checkpoints", None) or [])
  latest = mgr.latest_checkpoint
  if latest and latest not in listed:
    listed.append(latest)
  named = {os.path.basename(p) for p in listed}
  others = [p for p in scan_checkpoints(mgr.directory)
            if os.path.basename(p) not in named]
  return listed[::-1], others[::-1]


def _readable(path: str) -> bool:
  """Whether every tensor of the checkpoint at `path` can be read."""
  try:
    reader = tf.train.load_checkpoint(path)
    for key in reader.get_variable_to_shape_map():
      reader.get_tensor(key)
  except _READ_ERRORS:
    return False
  return True


def _incompatible(path, error, items, workdir) -> UserError:
  """The error for a readable checkpoint that does not fit this run."""
  saved = _saved_items(path)
  missing = sorted(set(items or ()) - saved) if saved else []
  if missing:
    what = (f"it holds no {', '.join(missing)}, which this run's mode and "
            "settings need")
  else:
    what = _mismatch(error)
  flags_file = os.path.join(workdir, FLAGS_FILE) if workdir else ""
  settings = (f" (the ones in {flags_file})" if os.path.isfile(flags_file)
              else "")
  return UserError(
      f"the checkpoint {path} is readable, but this run cannot resume from "
      f"it: {what}. It was written by a run with other settings{settings}; "
      "resume with those settings, or give this run a new --workdir. The "
      "checkpoints were left as they are")


def _saved_items(path: str) -> Set[str]:
  """The names of the top-level items of the checkpoint at `path` (none
  known for a checkpoint without an object graph)."""
  try:
    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
        tf.train.load_checkpoint(path).get_tensor(_OBJECT_GRAPH))
  except _READ_ERRORS + (message.DecodeError,):
    return set()
  return {child.local_name for child in graph.nodes[0].children}


def _mismatch(error: Exception) -> str:
  """What a failed restore says differs, in a few words."""
  text = " ".join(str(error).split())
  shape = r"(\([^)]*\))"
  keras = re.search(rf"variable\.shape={shape}, Received: value\.shape="
                    rf"{shape}\. Target variable: <Variable path=([^,>]+)",
                    text)
  plain = re.search(rf"incompatible tensor with shape {shape} when attempting "
                    rf"to restore variable with shape {shape} and name "
                    r"(\S+?)\.?(?: |$)", text)
  if keras or plain:
    here, there, name = (keras.groups() if keras else
                         (plain.group(2), plain.group(1), plain.group(3)))
    return (f"this run's {name} has shape {here}, where it holds one of "
            f"shape {there}")
  unbound = re.search(r"Found (\d+) Python objects that were not bound", text)
  if unbound:
    example = re.search(r"path=([^,>]+)", text)
    such_as = f", such as {example.group(1)}" if example else ""
    return f"{unbound.group(1)} of this run's variables{such_as} are not in it"
  return f"{type(error).__name__}: {_first_line(error)}"


def _first_line(error: Exception) -> str:
  text = str(error).strip()
  return text.splitlines()[0][:200] if text else ""
