"""Writes a `Dataset` as shards plus their manifest (`tools.make_shards`).

The train split is cut into `num_shards` files whose record counts differ
by at most one, so that processes reading files p, p+P, ... hold equal
counts when P divides `num_shards`. ArrayRecord shards keep the dataset's
order (record i is train example i), so a global shuffle of indices over
them is the in-memory stream itself. TFRecord shards, read front to back,
get the train examples in an order drawn from `seed`, so that a file holds
a mix of the classes rather than a run of one. The eval split keeps its
order in both formats; it goes into as many files as the train split, but
never more than it has examples.

The directory appears whole or not at all: the files are written to a
temporary directory next to `out`, which is renamed last.
"""

import json
import os
import shutil
import tempfile
from typing import Any, Dict

import numpy as np

from dist_loop.core.errors import UserError
from dist_loop.data import shard_format
from dist_loop.data.base import Dataset, int32_labels


def write(dataset: Dataset, fmt: str, num_shards: int, out: str, seed: int,
          description: Dict[str, Any]) -> Dict[str, Any]:
  """Writes `dataset` to `out` as `fmt` shards; returns the manifest.

  Args:
    dataset: the examples (in memory).
    fmt: "tfrecord" or "arrayrecord".
    num_shards: files of the train split.
    out: the directory to create; it must not exist, or be empty.
    seed: the order of TFRecord train shards.
    description: what made it (the dataset's name and options), kept in
      the manifest.

  Raises:
    UserError: `out` is in use, or there are fewer examples than shards.
  """
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise UserError(f"--out={out} exists and is not an empty directory; "
                    "give a new one")
  train_x, train_y = np.asarray(dataset.train_x), np.asarray(dataset.train_y)
  eval_x, eval_y = np.asarray(dataset.eval_x), np.asarray(dataset.eval_y)
  if len(train_x) < num_shards:
    raise UserError(f"--num_shards={num_shards} is more than the "
                    f"{len(train_x)} train examples; use at most that")
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".shards-", dir=parent)
  try:
    order = (np.random.RandomState(seed).permutation(len(train_x))
             if fmt == "tfrecord" else np.arange(len(train_x)))
    splits = {
        "train": _write_split(tmp, "train", train_x, train_y, order, fmt,
                              num_shards),
        "eval": _write_split(tmp, "eval", eval_x, eval_y,
                             np.arange(len(eval_x)), fmt,
                             min(num_shards, len(eval_x))),
    }
    splits["train"]["order"] = ("shuffled with seed %d" % seed
                                if fmt == "tfrecord" else "as loaded")
    manifest = {
        "version": shard_format.VERSION, "format": fmt,
        "made_from": description, "task": dataset.task,
        "num_classes": int(dataset.num_classes),
        "spec": {"x": _spec(train_x), "y": _spec(train_y)},
        "splits": splits,
    }
    with open(os.path.join(tmp, shard_format.MANIFEST), "w",
              encoding="utf-8") as f:
      json.dump(manifest, f, indent=1)
    if os.path.isdir(out):
      os.rmdir(out)
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return manifest


def _spec(array: np.ndarray) -> Dict[str, Any]:
  return {"dtype": array.dtype.name, "shape": list(array.shape[1:])}


def _write_split(directory: str, split: str, x: np.ndarray, y: np.ndarray,
                 order: np.ndarray, fmt: str, num_files: int):
  files = []
  for i, rows in enumerate(np.array_split(order, num_files)):
    name = shard_format.file_name(split, i, num_files, fmt)
    path = os.path.join(directory, name)
    writer = _writer(path, fmt)
    try:
      for r in rows:
        writer.write(shard_format.encode(x[r], y[r]))
    finally:
      writer.close()
    files.append({"name": name, "records": int(len(rows)),
                  "bytes": os.path.getsize(path),
                  "sha256": shard_format.sha256(path)})
  return {"records": int(len(order)), "files": files}


def _writer(path: str, fmt: str):
  if fmt == "tfrecord":
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.io.TFRecordWriter(path)
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  return array_record_module.ArrayRecordWriter(
      path, shard_format.ARRAYRECORD_OPTIONS)


def from_npz(path: str) -> Dataset:
  """A user's classification arrays: an .npz with x_train, y_train and
  x_test, y_test (the test pair is the eval split), inputs as they are.

  Raises:
    UserError: one line naming the file: unreadable, or a key missing.
  """
  keys = ("x_train", "y_train", "x_test", "y_test")
  try:
    with np.load(path, allow_pickle=False) as archive:
      missing = [k for k in keys if k not in archive.files]
      if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}; an npz for "
                        f"make_shards holds {', '.join(keys)}")
      arrays = [archive[k] for k in keys]
  except (OSError, ValueError) as e:
    raise UserError(f"{path} cannot be read as .npz ({e})") from None
  x_train, y_train, x_test, y_test = arrays
  num_classes = int(max(y_train.max(initial=0), y_test.max(initial=0))) + 1
  return Dataset(x_train, int32_labels(y_train), x_test,
                 int32_labels(y_test), num_classes, source=path)
