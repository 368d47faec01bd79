"""tf.data from shard files to batches, with the in-memory stream's rules.

Nothing here holds a split in memory: records are read, parsed (`x`, `y`
raw bytes, checked by size against the spec) and batched by tf.data, with
as many parallel reads and parses as the process has cores and a
prefetch, and eval reads its split front to back. Like every input of
`data/stream.py`, a pipeline runs without tf.data's autotuning thread, so
freeing it never waits on that thread (`stream.without_autotune`).

**ArrayRecord (random access)** keeps every guarantee of `data/stream.py`:
the global stream of example indices by (seed, position) is cut per
replica and per process the same way, and a pipeline reads only its own
replicas' records. Epoch e's order is `index_shuffle((seed, e))` of the
position within the epoch (`order="index_shuffle"`): a position maps to
its index in O(1), so a resume is a jump that reads nothing it skips, and
no per-epoch permutation is held in memory. `order="memory"` draws the
in-memory datasets' own permutation (an argsort of stateless uniforms:
8 bytes per example per epoch), so a run begun on in-memory data continues
on the same data as shards exactly. Either way N devices = 1 device.

**TFRecord (sequential)**: input pipeline p of P (a training process; an
async or ps worker) reads its own files, p, p+P, ..., so there must be P
files at least (`Split.check_pipelines`, which a run calls before it
writes anything). Its epoch e is those files in an order drawn from (seed,
e), each read front to back; consecutive records make its local replicas'
batches. A resume at step s is position s * (local examples per step) of
that stream: whole files before it are skipped by the manifest's counts,
and at most one file is read up to the position. The position is a
function of the step, so the checkpoint's step is the iterator's state.
With one process, N devices = 1 device; with P processes, each epoch
covers every record once when the processes' files hold equal counts
(`make_shards` balances them; --num_shards a multiple of P).

A record that does not match the spec stops the input with its file and
index (`SPEC_ERROR` in the error's message: `input_error`). So does an
ArrayRecord record whose chunk fails its checksum (`CORRUPT_ERROR`); with
`--skip_bad_records` it is read as an empty record instead, which the
parse refuses, so it is dropped and counted like any bad record. A corrupted
TFRecord file stops the input in one line too (TF's error names its byte
offset, not its file).
"""

import os
import queue
import re
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from dist_loop.core.errors import UserError
from dist_loop.data import bad_records, service, shard_format, stream

ORDERS = ("index_shuffle", "memory")
SPEC_ERROR = "does not match the manifest spec"
CORRUPT_ERROR = "cannot be read: the file is corrupted"
_no_autograph = stream.no_autograph
_FOREVER = np.iinfo(np.int64).max
_BLOCK_RECORDS = 256  # Records a read, and a parse, take at least.
_PAD = 498247692  # tf.random.experimental.index_shuffle's seed word.


class Split:
  """One split of a shards directory, as the input reads it.

  Args:
    data_dir: the shards directory.
    manifest: its manifest (`shard_format.read_manifest`).
    split: "train" or "eval".
    image_size: the side length the model wants for images, or None.
  """

  def __init__(self, data_dir: str, manifest: Dict[str, Any], split: str,
               image_size: Optional[int]):
    self.data_dir, self.split = data_dir, split
    self.format = manifest["format"]
    self.paths = shard_format.paths(data_dir, manifest, split)
    self.counts = shard_format.counts(manifest, split)
    self.num_records = sum(self.counts)
    self.spec = manifest["spec"]
    self.num_classes = manifest["num_classes"]
    shape = list(self.spec["x"]["shape"])
    self.resize = (image_size if image_size and len(shape) == 3
                   and shape[:2] != [image_size] * 2 else None)
    if self.resize:
      shape[:2] = [image_size, image_size]
    self.x_shape, self.y_shape = tuple(shape), tuple(self.spec["y"]["shape"])
    self._arrayrecords = (_ArrayRecords(self.paths, self.counts)
                          if self.format == "arrayrecord" else None)
    # Drops and counts unparsable records (`data/bad_records.py`), or None.
    self.skipper = None
    # The tf.data service that parses the training input (`data/service.py`).
    self.service = ""

  def parse(self, serialized, files, indices):
    """A batch of serialized Examples -> (x, y), each checked by size;
    `files`, `indices` name the records in an error."""
    # An Example starts with its `features` field (tag 0x0a) and holds at
    # least x's and y's bytes: what is not is named before the parse
    # (which would fail naming neither file nor record).
    least = sum(shard_format.record_bytes(self.spec[k]) for k in ("x", "y"))
    bad = tf.where(tf.logical_or(
        tf.strings.substr(serialized, 0, 1) != "\n",
        tf.strings.length(serialized) < least))[:1, 0]
    check = tf.debugging.Assert(tf.size(bad) == 0, [
        "record", tf.gather(indices, bad), "of", tf.gather(files, bad),
        f"{SPEC_ERROR}: it is not a tf.train.Example of x and y"])
    with tf.control_dependencies([check]):
      features = tf.io.parse_example(serialized, {
          key: tf.io.FixedLenFeature([], tf.string) for key in ("x", "y")})
    out = []
    for key, shape in (("x", self.spec["x"]["shape"]),
                       ("y", self.spec["y"]["shape"])):
      raw = features[key]
      size = shard_format.record_bytes(self.spec[key])
      bad = tf.where(tf.strings.length(raw) != size)[:1, 0]  # The first.
      check = tf.debugging.Assert(
          tf.size(bad) == 0,
          ["record", tf.gather(indices, bad), "of", tf.gather(files, bad),
           f"{SPEC_ERROR}: its {key} is not {size} bytes"])
      with tf.control_dependencies([check]):
        values = tf.io.decode_raw(raw, self.spec[key]["dtype"],
                                  little_endian=True)
      out.append(tf.reshape(values, [-1] + list(shape)))
    # Labels are class (or token) ids: one outside [0, num_classes) would
    # fail the loss without a name, or train on garbage.
    ids = tf.reshape(tf.cast(out[1], tf.int64), [tf.shape(serialized)[0], -1])
    bad = tf.where(tf.reduce_any(tf.logical_or(
        ids < 0, ids >= self.num_classes), axis=1))[:1, 0]
    check = tf.debugging.Assert(
        tf.size(bad) == 0,
        ["record", tf.gather(indices, bad), "of", tf.gather(files, bad),
         f"{SPEC_ERROR}: its y is outside [0, num_classes="
         f"{self.num_classes})"])
    with tf.control_dependencies([check]):
      out[1] = tf.identity(out[1])
    x, y = out
    if self.resize:
      x = tf.image.resize(x, (self.resize, self.resize), method="bilinear")
    return x, y

  # -- random access --

  def read(self, indices):
    """Records by global index (ArrayRecord): (serialized, their files,
    their indices within them)."""
    indices = tf.cast(indices, tf.int64)  # The in-memory order's are int32.
    # A corrupted record: skipped and counted by the skipper, else an error.
    self._arrayrecords.skip_corrupt = self.skipper is not None
    serialized = tf.numpy_function(self._arrayrecords.read, [indices],
                                   tf.string, stateful=False)
    serialized.set_shape(indices.shape)
    starts = np.cumsum([0] + self.counts)[:-1]
    file_of = tf.searchsorted(tf.constant(starts[1:], tf.int64), indices,
                              side="right")
    return (serialized, tf.gather(tf.constant(self.paths), file_of),
            indices - tf.gather(tf.constant(starts, tf.int64), file_of))

  # -- sequential --

  def check_pipelines(self, pipelines: int) -> None:
    """Refuses TFRecord shards too few for `pipelines` input pipelines:
    each reads its own files (p, p+P, ...), so each needs one at least.
    ArrayRecord shards feed any number.

    Raises:
      UserError: one line naming the directory, the counts and the fix.
    """
    files = len(self.paths)
    if self.format != "tfrecord" or files >= pipelines:
      return
    raise UserError(
        f"{self.data_dir} has {files} TFRecord {self.split} "
        f"shard{'s' * (files != 1)} for {pipelines} input pipelines (one "
        f"per training process; per worker under --mode=async and "
        f"--mode=ps), each of which reads its own files; make the shards "
        f"again with python -m tools.make_shards --num_shards a multiple "
        f"of {pipelines}")

  def records(self, files_of, seed: int, start: int, pipeline: int,
              pipelines: int) -> tf.data.Dataset:
    """This pipeline's stream of TFRecords from its position `start`,
    epoch after epoch: `files_of(path, skip)` of each file it reads
    (`read_file`'s (serialized, file, index) records, or `read_blocks`)."""
    self.check_pipelines(pipelines)  # A backstop: `run` checks at start.
    # Sliced in the graph: under --mode=ps, `pipeline` is a tensor, drawn
    # on the worker from a counter on a parameter server.
    paths = tf.constant(self.paths)[pipeline::pipelines]
    counts_t = tf.constant(self.counts, tf.int64)[pipeline::pipelines]
    first_epoch = start // tf.reduce_sum(counts_t)
    offset = start % tf.reduce_sum(counts_t)

    @_no_autograph
    def epoch(e):
      keys = tf.random.stateless_uniform(
          tf.shape(counts_t), seed=tf.stack([tf.constant(seed, tf.int64), e]))
      order = tf.argsort(keys)
      skip_all = tf.where(e == first_epoch, offset, tf.constant(0, tf.int64))
      sizes = tf.gather(counts_t, order)
      skips = tf.clip_by_value(skip_all - (tf.cumsum(sizes) - sizes), 0,
                               sizes)
      # The files wholly before the position are not opened.
      kept = skips < sizes
      return (tf.data.Dataset.from_tensor_slices(
          (tf.boolean_mask(tf.gather(paths, order), kept),
           tf.boolean_mask(skips, kept)))
              .flat_map(_no_autograph(files_of)))

    return tf.data.Dataset.range(first_epoch, _FOREVER).flat_map(epoch)


def read_file(path, skip):
  """One TFRecord file's (serialized, file, index) records from `skip`
  (zipped, not mapped: no function call per record)."""
  return tf.data.Dataset.zip((tf.data.TFRecordDataset(path).skip(skip),
                              tf.data.Dataset.from_tensors(path).repeat(),
                              tf.data.Dataset.range(skip, _FOREVER)))


def read_blocks(path, skip):
  """`read_file`'s records in blocks of up to `_BLOCK_RECORDS` (a file's
  last block is shorter), for `Dataset.rebatch` to cut into batches: the
  streams above a file, and the file and index of each record, then cost
  tf.data's per-element work once a block rather than once a record."""
  return tf.data.Dataset.zip((
      tf.data.TFRecordDataset(path).skip(skip).batch(_BLOCK_RECORDS),
      tf.data.Dataset.range(skip, _FOREVER, _BLOCK_RECORDS))).map(
          _no_autograph(lambda serialized, first: (
              serialized, tf.fill(tf.shape(serialized), path),
              first + tf.range(tf.size(serialized, out_type=tf.int64)))))


class _ArrayRecords:
  """Records by global index from a split's ArrayRecord files.

  Readers are kept in a pool of sets, one file's reader each, a set used by
  one call at a time: tf.data calls from its own threads, whose Python
  thread state (and so a `threading.local`) lives for one call only, which
  would open every file again at every batch. Each record is a seek and a
  read on a reader without parallelism (`max_parallelism:0`, no read-ahead):
  the reader's list read hands every record to its thread pool, which
  costs about three times the CPU per record, a reader with a pool of one
  thread costs more per seek and read than one with none, and tf.data's
  parallel calls are the parallelism here."""

  def __init__(self, paths: List[str], counts: List[int]):
    self._paths = paths
    self._starts = np.cumsum([0] + list(counts))
    self._idle = queue.SimpleQueue()  # Reader sets not in use.
    # A record that fails to read is b"" (which the parse refuses) if set,
    # else an error naming it (`CORRUPT_ERROR`).
    self.skip_corrupt = False

  def read(self, indices: np.ndarray) -> np.ndarray:
    try:
      readers = self._idle.get_nowait()
    except queue.Empty:
      readers = {}
    try:
      return self._read(readers, indices)
    finally:
      self._idle.put(readers)

  def _read(self, readers, indices: np.ndarray) -> np.ndarray:
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    file_of = np.searchsorted(self._starts, indices, side="right") - 1
    within = indices - self._starts[file_of]
    out = np.empty(len(indices), dtype=object)
    for row, (f, index) in enumerate(zip(file_of.tolist(), within.tolist())):
      reader = readers.get(f)
      if reader is None:
        reader = readers[f] = array_record_module.ArrayRecordReader(
            self._paths[f], "readahead_buffer_size:0,max_parallelism:0")
      try:
        reader.seek(index)
        out[row] = reader.read()
      except RuntimeError as e:  # Riegeli: a chunk failing its checksum.
        # The reader fails every read after one failure: it is closed and
        # not used again.
        del readers[f]
        try:
          reader.close()
        except RuntimeError:
          pass
        if not self.skip_corrupt:
          raise tf.errors.DataLossError(
              None, None, f"record {index} of {self._paths[f]} "
              f"{CORRUPT_ERROR} ({str(e).splitlines()[0][:160]})") from None
        out[row] = b""
    return out


def shuffled_indices(n: int, seed: int, start: int) -> tf.data.Dataset:
  """Example indices from stream position `start`: position p of epoch e
  is `index_shuffle(p mod n, (seed, e))`, computed, never stored."""
  @_no_autograph
  def indices(positions):
    epoch, within = positions // n, positions % n
    # The raw op: its wrapper pads a per-element [n, 2] seed along the
    # wrong axis. The first word is the one the wrapper adds to a [2] seed.
    seeds = tf.stack([tf.fill(tf.shape(epoch), tf.constant(_PAD, tf.int64)),
                      tf.fill(tf.shape(epoch), tf.constant(seed, tf.int64)),
                      epoch], axis=1)
    return tf.raw_ops.RandomIndexShuffle(
        index=within, seed=seeds, rounds=4,
        max_index=tf.fill(tf.shape(within), tf.constant(n - 1, tf.int64)))

  return (tf.data.Dataset.range(start, _FOREVER).batch(1024).map(indices)
          .unbatch())


def train_dataset_fn(split: Split, global_batch_size: int, seed: int,
                     start_step: int, order: str):
  """`dataset_fn(input_context)` of the training split (`stream`'s rules:
  each element one replica's batch, a pipeline's local replicas in turn)."""

  def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
    per_replica = ctx.get_per_replica_batch_size(global_batch_size)
    if split.format == "arrayrecord":
      start = start_step * global_batch_size
      if order == "memory":
        ids = stream.index_stream(split.num_records, seed, start)
      else:
        ids = shuffled_indices(split.num_records, seed, start)
      # Read and parsed `block` batches at a time: a read is a Python call
      # and a parse a dozen ops, whose fixed costs a small batch would pay
      # each time; the block is cut back into batches after the parse.
      block = max(1, _BLOCK_RECORDS // per_replica)
      ids = stream.cut(ids, ctx, per_replica).batch(block, drop_remainder=True)
      ds = ids.map(_no_autograph(lambda b: split.read(tf.reshape(b, [-1]))),
                   num_parallel_calls=stream.parallel_calls(),
                   deterministic=True)
      records = ds.unbatch()
    else:
      # Parsed `block` batches at a time too (consecutive records make
      # consecutive batches, so the batches are the same); one batch at a
      # time through a tf.data service, which shards by batch.
      block = 1 if split.service else max(1, _BLOCK_RECORDS // per_replica)
      local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
      start = start_step * per_replica * local

      def stream_of(files_of):
        return split.records(files_of, seed, start, ctx.input_pipeline_id,
                             ctx.num_input_pipelines)

      if split.skipper is not None:  # It batches the records itself.
        records = stream_of(read_file)
      else:
        ds = stream_of(read_blocks).rebatch(per_replica * block,
                                            drop_remainder=True)
        if split.service:
          ds = service.shard_point(ds)
    if split.skipper is not None:
      ds = split.skipper.train_batches(records, split.parse, per_replica,
                                       _places(ctx, global_batch_size,
                                               per_replica, start_step))
    else:
      ds = ds.map(_no_autograph(lambda *r: _batches(split.parse(*r), block)),
                  num_parallel_calls=stream.parallel_calls(),
                  deterministic=True)
      if block > 1:
        ds = ds.unbatch()
    if split.service:
      ds = service.distribute(ds, split.service)
    return stream.without_autotune(ds.prefetch(tf.data.AUTOTUNE))

  return dataset_fn


def _batches(parsed, block: int):
  """A parsed block of `block` batches, each tensor [block, batch, ...]
  (unchanged for one)."""
  if block == 1:
    return parsed
  return tuple(tf.reshape(t, [block, -1] + t.shape[1:].as_list())
               for t in parsed)


def _places(ctx: tf.distribute.InputContext, global_batch_size: int,
            per_replica: int, start_step: int):
  """fn(i) -> the place in the stream of steps (`data/bad_records.py`) of
  record i of the pipeline `ctx` names, which starts at `start_step`: the
  pipeline reads K = per_replica * (its local replicas) records a step,
  places [p*K, (p+1)*K) of each step's `global_batch_size` for pipeline p,
  as the TFRecord and ArrayRecord inputs above both cut them."""
  per_step = per_replica * (ctx.num_replicas_in_sync
                            // ctx.num_input_pipelines)
  # A tensor under --mode=ps (a worker's draw from a counter).
  pipeline = tf.cast(ctx.input_pipeline_id, tf.int64)

  def place(i):
    return ((start_step + i // per_step) * global_batch_size
            + pipeline * per_step + i % per_step)

  return place


def eval_dataset(split: Split, batch_size: int) -> tf.data.Dataset:
  """The split in order, last partial batch kept (with a skipper, bad
  records left out, not counted)."""
  if split.format == "arrayrecord":
    ds = (tf.data.Dataset.range(split.num_records).batch(batch_size)
          .map(_no_autograph(split.read)))
    records = ds.unbatch()
  else:
    files = tf.data.Dataset.from_tensor_slices(
        (split.paths, tf.zeros([len(split.paths)], tf.int64)))
    if split.skipper is not None:
      records = files.flat_map(_no_autograph(read_file))
    else:
      ds = files.flat_map(_no_autograph(read_blocks)).rebatch(batch_size)
  if split.skipper is not None:
    ds = split.skipper.batches(records, split.parse, batch_size)
  else:
    ds = ds.map(_no_autograph(split.parse),
                num_parallel_calls=stream.parallel_calls(), deterministic=True)
  return stream.without_autotune(ds.prefetch(tf.data.AUTOTUNE))


def input_error(error: Exception) -> Optional[UserError]:
  """The one line of a tf.data error about bad records (`Split.parse`,
  `bad_records.Skipper`, a corrupted shard), or None for any other error."""
  message = str(error)
  found = (re.search(r"\[record\] \[(\d+)\] \[of\] \[(.*?)\] \[(%s[^\]]*)\]"
                     % SPEC_ERROR, message)
           or re.search(r"record (\d+) of (.*?) (%s) \(" % CORRUPT_ERROR,
                        message))
  if found:
    index, path, what = found.groups()
    fix = "make the shards again with tools.make_shards"
    if not os.path.basename(path).startswith("eval"):  # Never skipped.
      fix += ", or pass --skip_bad_records"
    return UserError(f"{path}: record {index} {what}; {fix}")
  found = re.search(r"corrupted record at (\d+)", message)
  if found and isinstance(error, tf.errors.DataLossError):
    return UserError(
        f"a TFRecord shard is corrupted at byte {found.group(1)} (TF does "
        "not name the file: python -m tools.make_shards --verify=DIR does); "
        "make the shards again with tools.make_shards")
  found = re.search(r"\[(\d+)\] \[(%s[^\]]*)\]" % bad_records.LIMIT_ERROR,
                    message)
  if found:
    return UserError(f"{found.group(1)} {found.group(2)}; fix or make the "
                     "shards again, or raise --max_bad_records")
  return None


def head(split: Split, count: int) -> Tuple[np.ndarray, np.ndarray]:
  """The split's first `count` examples as numpy arrays (a probe batch)."""
  x, y = next(iter(eval_dataset(split, count)))
  return x.numpy(), y.numpy()
