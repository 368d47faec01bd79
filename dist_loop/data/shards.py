"""`--dataset=shards --data_dir=DIR`: a dataset that stays in its files.

`tools.make_shards` writes any registered dataset (or the user's own npz or
text file) to `DIR`; the manifest there says the format, the task, the
classes and the shapes, so no other flag describes the data.

The `Dataset` this loader returns holds `Column`s instead of arrays. A
column answers what the rest of the library asks of a dataset's arrays
(shape, dtype, length, the first few examples for a probe batch) without
loading the split, and the input functions of `data/stream.py` hand it the
building of the tf.data pipeline (`data/shard_stream.py`). So every mode
and model that trains on in-memory data trains on shards unchanged, and
memory does not grow with the dataset.

Before anything trains, the manifest and every shard are checked against
each other (`shard_format.check_files`): a missing, unreadable, truncated
or empty shard, or one the manifest miscounts, is one line naming it.
Those checks read no shard's contents; the checksums, which read them all,
are opt-in (`--verify_checksums`, or once: `tools.make_shards --verify`).
The loader knows no cluster: the run checks that TFRecord shards have a
train file for each of its input pipelines (`Column.check_pipelines`,
called through `data.check_pipelines`) before it writes anything.
"""

import dataclasses
from typing import Dict, Optional

import numpy as np

from dist_loop.core.errors import UserError
from dist_loop.core.options import option
from dist_loop.data import bad_records, shard_format, shard_stream
from dist_loop.data.base import DATASETS, Dataset, InputColumn


@dataclasses.dataclass(frozen=True)
class ShardsOptions:
  """`--dataset=shards`: how the shards are read."""

  shard_order: str = option(
      "index_shuffle", "ArrayRecord shards: the order of each epoch. "
      "index_shuffle: computed per position, O(1) memory; memory: the "
      "in-memory datasets' order, so a run begun on them continues exactly "
      "(8 bytes per example per epoch).", choices=shard_stream.ORDERS,
      layout=True)
  skip_bad_records: bool = option(
      False, "Skip and count training records that fail to parse "
      "(data/bad_records: the run's count, kept in its checkpoints) "
      "instead of stopping at the first.")
  max_bad_records: int = option(
      100, "With --skip_bad_records: stop past this many bad records in "
      "the run, resumes included.", lower=0)
  data_service: str = option(
      "", "A tf.data service dispatcher (grpc://HOST:PORT) whose workers "
      "parse the training input; TFRecord shards (docs/data.md).")
  verify_checksums: bool = option(
      False, "Also compare every shard's SHA-256 with the manifest before "
      "training: a full read of the shards at every start and resume (the "
      "files' presence, sizes and record counts are always checked). To "
      "verify a directory once: python -m tools.make_shards --verify=DIR.")


class Column(InputColumn):
  """One column (`x` or `y`) of a split of shards, in place of an array.

  It has the array's `shape`, `dtype`, `ndim` and length; `column[:k]`
  reads the first k examples. Turning it into a whole array is refused,
  since that is what shards are for avoiding.
  """

  def __init__(self, split: shard_stream.Split, key: str, order: str):
    self._split, self._key, self._order = split, key, order
    shape = split.x_shape if key == "x" else split.y_shape
    self.shape = (split.num_records,) + tuple(shape)
    self.dtype = np.dtype("float32" if key == "x" and split.resize
                          else split.spec[key]["dtype"])
    self.ndim = len(self.shape)
    self.skipper = split.skipper

  def __len__(self) -> int:
    return self.shape[0]

  def __getitem__(self, item):
    if not (isinstance(item, slice) and item.start in (None, 0)
            and item.step in (None, 1)):
      raise TypeError("a shards column reads only its first examples "
                      "(column[:k])")
    count = min(len(self), item.stop if item.stop is not None else len(self))
    return shard_stream.head(self._split, count)[0 if self._key == "x" else 1]

  def __array__(self, *args, **kwargs):
    raise TypeError("a shards column is not loaded whole; read it through "
                    "data.train_dataset_fn or data.eval_dataset")

  def train_dataset_fn(self, global_batch_size: int, seed: int,
                       start_step: int):
    return shard_stream.train_dataset_fn(self._split, global_batch_size,
                                         seed, start_step, self._order)

  def eval_dataset(self, batch_size: int):
    return shard_stream.eval_dataset(self._split, batch_size)

  def check_pipelines(self, pipelines: int) -> None:
    self._split.check_pipelines(pipelines)


def _skipper(dataset: Dataset) -> Optional[bad_records.Skipper]:
  column = dataset.train_x
  return column.skipper if isinstance(column, Column) else None


def input_metrics(dataset: Dataset) -> Dict[str, float]:
  """What the input reports besides the trainer's metrics: the run's bad
  records (`data/bad_records`), or nothing."""
  skipper = _skipper(dataset)
  return {} if skipper is None else skipper.metrics()


def checkpoint_items(dataset: Dataset) -> Dict[str, object]:
  """The input's own checkpoint items: with --skip_bad_records, the count
  of bad records (`bad_records`, a `bad_records.Ledger`); else none. Its
  variables are made here, on this process's host: call it once the
  trainer's strategy is built (under --mode=ps the workers' inputs reach
  them on the chief)."""
  skipper = _skipper(dataset)
  return {} if skipper is None else {"bad_records": skipper.ledger}


@DATASETS.register("shards")
def load(data_dir, seed, image_size=None, options=None) -> Dataset:
  """The shards in `data_dir`, checked against their manifest."""
  del seed  # The split was made when the shards were.
  options = options or ShardsOptions()
  if not data_dir:
    raise UserError("--dataset=shards needs --data_dir=DIR, a directory "
                    "written by tools.make_shards")
  manifest = shard_format.read_manifest(data_dir)
  if options.data_service and (manifest["format"] != "tfrecord"
                               or options.skip_bad_records):
    raise UserError(
        f"--data_service takes TFRecord shards without --skip_bad_records "
        f"({data_dir} holds {manifest['format']} shards): the service runs "
        "the input's graph in other processes, where Python cannot go; "
        "make TFRecord shards, or train without --data_service")
  if manifest["format"] == "arrayrecord":
    need_array_record()
  shard_format.check_files(data_dir, manifest, options.verify_checksums)
  columns = {}
  for split in shard_format.SPLITS:
    reader = shard_stream.Split(data_dir, manifest, split, image_size)
    if split == "train" and options.skip_bad_records:
      reader.skipper = bad_records.Skipper(options.max_bad_records, data_dir)
    if split == "train":
      reader.service = options.data_service
    for key in ("x", "y"):
      columns[f"{split}_{key}"] = Column(reader, key, options.shard_order)
  return Dataset(num_classes=manifest["num_classes"], task=manifest["task"],
                 source=data_dir, **columns)


def verify(data_dir: str) -> str:
  """Checks `data_dir` against its manifest, every shard's SHA-256
  included (`tools.make_shards --verify`); returns a line saying so.

  Raises:
    UserError: one line naming the manifest or the shard that disagrees.
  """
  manifest = shard_format.read_manifest(data_dir)
  if manifest["format"] == "arrayrecord":
    need_array_record()
  shard_format.check_files(data_dir, manifest, verify_checksums=True)
  files = sum(len(manifest["splits"][s]["files"])
              for s in shard_format.SPLITS)
  return (f"{data_dir}: {files} {manifest['format']} shards match the "
          "manifest, SHA-256 included")


def need_array_record() -> None:
  try:
    import array_record.python.array_record_module  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise UserError("ArrayRecord shards need the array-record package; "
                    "pip install array-record") from None


load.Options = ShardsOptions
