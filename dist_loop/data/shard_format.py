"""Shards on disk: the manifest, the record encoding, and their checks.

A shards directory (written by `tools.make_shards`) holds `manifest.json`
and, per split (`train`, `eval`), files of records:

* `tfrecord`: TFRecord files, read front to back (the TF ecosystem's format).
* `arrayrecord`: ArrayRecord files (the `array_record` package), which read
  any record by its index. That is what lets the input draw a global
  shuffle of indices and jump to any position, reading only the records a
  step uses (`data/shard_stream.py`).

Every record is a serialized `tf.train.Example` with two bytes features,
`x` and `y`: the raw little-endian values of one example's input and
label, whose dtype and shape the manifest's feature spec gives. Raw bytes
(not a float_list) keep a record as small as the array and its parse one
`decode_raw`; a record whose bytes do not match the spec is refused by
size, naming its file and index.

The manifest is the contract: the task, the classes, the spec, per split
the files in order with their record counts, sizes and SHA-256 checksums.
`check_files` compares it with the files before anything trains, so a
missing, truncated, empty or swapped shard stops the run in one line; so
does a manifest or shard that is not a regular file (a FIFO would block
the read, a device never end it), checked before it is opened. The
manifest's values are checked when it is read: `num_classes` a positive
integer up to `MAX_CLASSES`, shapes of positive integers, dtypes from
`DTYPES` and the labels (`y`) of an integer dtype, since both tasks'
labels are class or token ids; a label outside [0, num_classes) is refused
when its record is parsed (`shard_stream.Split.parse`). Records do not
carry their dtype: values of another dtype of the same size (int32 read as
float32 x) are not detectable.
"""

import hashlib
import json
import os
import stat
from typing import Any, Dict, List

import numpy as np

from dist_loop.core.errors import UserError

MANIFEST = "manifest.json"
FORMATS = ("tfrecord", "arrayrecord")
SUFFIX = {"tfrecord": ".tfrecord", "arrayrecord": ".arrayrecord"}
VERSION = 1
DTYPES = ("float32", "int32", "uint8", "int64")
LABEL_DTYPES = ("int32", "uint8", "int64")
# The most classes (or tokens) a manifest may declare: the model's output
# layer has a row per class.
MAX_CLASSES = 1 << 20
# The most bytes an example's x or y may declare.
MAX_RECORD_BYTES = 1 << 30
SPLITS = ("train", "eval")
# ArrayRecord's writer options. group_size:1 puts each record in a chunk of
# its own, so a random read decodes one record, not a group of them. That
# chunk is stored uncompressed: decompressing it would cost about a third
# of a read's CPU on every read, which the training input pays per record;
# the files are larger for it. Each chunk records its own compression, so
# shards written compressed (the default before) read as before.
ARRAYRECORD_OPTIONS = "group_size:1,uncompressed"


def file_name(split: str, index: int, count: int, fmt: str) -> str:
  return f"{split}-{index:05d}-of-{count:05d}{SUFFIX[fmt]}"


def encode(x: np.ndarray, y: np.ndarray) -> bytes:
  """One example as a serialized tf.train.Example (x, y: raw bytes)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  feature = {
      key: tf.train.Feature(bytes_list=tf.train.BytesList(
          value=[np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<"))
                 .tobytes()]))
      for key, v in (("x", x), ("y", y))}
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString()


def sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def read_manifest(data_dir: str) -> Dict[str, Any]:
  """The manifest of `data_dir`, checked for the fields the input needs.

  Raises:
    UserError: one line naming the manifest: missing, not JSON, or lacking
      or mistyping a field.
  """
  path = os.path.join(data_dir, MANIFEST)
  fix = f"make the shards again with tools.make_shards --out={data_dir}"
  try:
    _check_regular(path, fix)
    with open(path, encoding="utf-8") as f:
      manifest = json.load(f)
  except FileNotFoundError:
    raise UserError(f"{path} does not exist: --data_dir must be a directory "
                    "written by tools.make_shards") from None
  except (OSError, ValueError) as e:
    raise UserError(f"{path} cannot be read as JSON ({e}); {fix}") from None
  problem = _manifest_problem(manifest)
  if problem:
    raise UserError(f"{path}: {problem}; {fix}")
  return manifest


def _manifest_problem(m) -> str:
  if not isinstance(m, dict) or m.get("version") != VERSION:
    return f"not a version-{VERSION} manifest"
  if m.get("format") not in FORMATS:
    return f"format {m.get('format')!r} is not one of {', '.join(FORMATS)}"
  classes = m.get("num_classes")
  if (not _is_int(classes) or not 1 <= classes <= MAX_CLASSES):
    return (f"num_classes {classes!r} is not an integer from 1 to "
            f"{MAX_CLASSES}")
  if not isinstance(m.get("spec"), dict):
    return "it has no spec of x and y"
  for key in ("x", "y"):
    spec = m["spec"].get(key)
    if (not isinstance(spec, dict) or not isinstance(spec.get("shape"), list)
        or spec.get("dtype") not in DTYPES):
      return (f"the spec of {key} is not {{dtype: one of "
              f"{', '.join(DTYPES)}, shape}}")
    if not all(_is_int(d) and d >= 1 for d in spec["shape"]):
      return (f"the spec of {key} has shape {spec['shape']}, not a list of "
              "positive integers")
    if record_bytes(spec) > MAX_RECORD_BYTES:
      return (f"the spec of {key} ({spec['shape']} {spec['dtype']}) is over "
              f"{MAX_RECORD_BYTES} bytes an example")
  if m["spec"]["y"]["dtype"] not in LABEL_DTYPES:
    return (f"the spec of y has dtype {m['spec']['y']['dtype']}; labels are "
            f"class or token ids, one of {', '.join(LABEL_DTYPES)}")
  for split in SPLITS:
    files = m.get("splits", {}).get(split, {}).get("files")
    if not files or not all(isinstance(f, dict) and {"name", "records",
                                                     "bytes", "sha256"}
                            <= set(f) for f in files):
      return f"the {split} split lists no files with name, records, bytes"
  return ""


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def record_bytes(spec: Dict[str, Any]) -> int:
  """The size of one example's raw `x` or `y` bytes under `spec`."""
  size = np.dtype(spec["dtype"]).itemsize
  for d in spec["shape"]:  # Python ints: no overflow.
    size *= int(d)
  return size


def _check_regular(path: str, fix: str) -> None:
  """Refuses a path that is not a regular file (after symlinks), before
  anything opens it: a FIFO blocks an open, a device never ends a read.

  Raises:
    OSError: from os.stat (FileNotFoundError: it does not exist).
    UserError: one line naming it.
  """
  mode = os.stat(path).st_mode
  if not stat.S_ISREG(mode):
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO"
            if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode)
            or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a file")
    raise UserError(f"{path} is not a regular file ({kind}); {fix}")


def paths(data_dir: str, manifest, split: str) -> List[str]:
  return [os.path.join(data_dir, f["name"])
          for f in manifest["splits"][split]["files"]]


def counts(manifest, split: str) -> List[int]:
  return [int(f["records"]) for f in manifest["splits"][split]["files"]]


def check_files(data_dir: str, manifest, verify_checksums: bool) -> None:
  """Compares every shard with the manifest before anything trains.

  Checks that each file exists and can be read, has the manifest's size
  (a truncated or swapped shard does not), holds at least one record, and
  (ArrayRecord, which knows its count cheaply) the manifest's record
  count; with `verify_checksums`, its SHA-256 too (one read of every shard,
  streamed in 1 MB chunks).

  Raises:
    UserError: one line naming the file and what disagrees.
  """
  fix = "make the shards again with tools.make_shards"
  for split in SPLITS:
    for entry, path in zip(manifest["splits"][split]["files"],
                           paths(data_dir, manifest, split)):
      if int(entry["records"]) < 1:
        raise UserError(f"{path} is an empty shard (0 records in the "
                        f"manifest); {fix} with fewer --num_shards")
      try:
        _check_regular(path, f"the manifest lists it; {fix}")
        size = os.path.getsize(path)
        if size != int(entry["bytes"]):
          raise UserError(f"{path} has {size} bytes, the manifest says "
                          f"{entry['bytes']} (truncated or replaced); {fix}")
        with open(path, "rb"):
          pass
      except OSError as e:
        raise UserError(f"{path} cannot be read ({e.strerror}); the manifest "
                        f"lists it; {fix}") from None
      if manifest["format"] == "arrayrecord":
        found = arrayrecord_count(path)
        if found != int(entry["records"]):
          raise UserError(f"{path} holds {found} records, the manifest "
                          f"says {entry['records']}; {fix}")
      if verify_checksums and sha256(path) != entry["sha256"]:
        raise UserError(f"{path} does not match the manifest's SHA-256 "
                        f"(changed since it was written); {fix}")


def arrayrecord_count(path: str) -> int:
  """The record count of an ArrayRecord file, from its footer.

  Raises:
    UserError: the file is not a readable ArrayRecord file.
  """
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  try:
    reader = array_record_module.ArrayRecordReader(path)
  except (RuntimeError, ValueError, OSError) as e:
    raise UserError(f"{path} is not a readable ArrayRecord file "
                    f"({str(e).splitlines()[0][:120]}); make the shards again "
                    "with tools.make_shards") from None
  try:
    return int(reader.num_records())
  finally:
    reader.close()
