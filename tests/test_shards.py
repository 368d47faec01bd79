"""Shards keep the in-memory input's guarantees: exactly once per epoch over
replicas and processes, N devices = 1 device, a resume that is a jump."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from dist_loop.core.errors import UserError
from dist_loop.data import bad_records, shard_format, shard_stream
from dist_loop.data import shard_writer, shards
from dist_loop.data import stream
from dist_loop.data.base import Dataset
from dist_loop.runtime import strategy as strategy_lib

N = 96  # Examples: one epoch is 4 steps of 24.
BATCH = 24


@pytest.fixture(scope="module")
def index_shards(tmp_path_factory):
  """Shards whose example i has input i: {format: data_dir}."""
  x = np.arange(N, dtype=np.float32)[:, None]
  y = np.zeros(N, np.int32)
  dataset = Dataset(x, y, x[:10], y[:10], 2)
  root = tmp_path_factory.mktemp("shards")
  return {fmt: _write(dataset, fmt, str(root / fmt), num_shards=4)
          for fmt in shard_format.FORMATS}


def _write(dataset, fmt, out, num_shards):
  shard_writer.write(dataset, fmt, num_shards, out, seed=3, description={})
  return out


def _column(data_dir, order="index_shuffle"):
  return shards.load(data_dir, 0, options=shards.ShardsOptions(
      shard_order=order)).train_x


def _ids(fn, replicas, steps, pipelines=1, pipeline=0):
  """[step][replica] -> example ids, through the loop's own feed."""
  devices = [d.name for d in tf.config.list_logical_devices("CPU")]
  strategy = strategy_lib.mirrored(devices[:replicas])
  if pipelines == 1:
    it = stream.replica_input(strategy, fn)
    rows = lambda: strategy.experimental_local_results(  # pylint: disable=g-long-lambda
        stream.replica_batches(strategy, next(it))[0])
  else:  # One process's pipeline of a multi-process run.
    ctx = tf.distribute.InputContext(pipelines, pipeline,
                                     replicas * pipelines)
    it = iter(fn(ctx))
    rows = lambda: [next(it)[0] for _ in range(replicas)]  # pylint: disable=g-long-lambda
  return [[np.asarray(r).ravel().astype(int).tolist() for r in rows()]
          for _ in range(steps)]


@pytest.mark.parametrize("fmt", shard_format.FORMATS)
def test_an_epoch_covers_each_example_once_over_replicas_and_processes(
    index_shards, fmt):
  fn = _column(index_shards[fmt]).train_dataset_fn(BATCH, 5, 0)
  one_process = _ids(fn, 2, N // BATCH)
  seen = sum((sum(step, []) for step in one_process), [])
  assert sorted(seen) == list(range(N))
  two = [_ids(fn, 1, N // BATCH, pipelines=2, pipeline=p) for p in (0, 1)]
  seen = sum((sum(step, []) for p in two for step in p), [])
  assert sorted(seen) == list(range(N))
  if fmt == "tfrecord":  # Each process reads its own files...
    halves = [set(sum((sum(s, []) for s in p), [])) for p in two]
    assert not halves[0] & halves[1]
    with pytest.raises(UserError, match="4 TFRecord train shards for 8 "
                       "input pipelines"):  # ...so one at least for each.
      _ids(fn, 1, 1, pipelines=8)


@pytest.mark.parametrize("fmt", shard_format.FORMATS)
def test_a_resume_continues_at_the_exact_position(index_shards, fmt):
  col = _column(index_shards[fmt])
  whole = _ids(col.train_dataset_fn(BATCH, 5, 0), 2, 7)
  resumed = _ids(col.train_dataset_fn(BATCH, 5, 3), 2, 4)
  assert resumed == whole[3:]


def test_random_access_batches_do_not_depend_on_the_replica_count(
    index_shards):
  col = _column(index_shards["arrayrecord"])
  one = _ids(col.train_dataset_fn(BATCH, 5, 0), 1, 6)
  four = _ids(col.train_dataset_fn(BATCH, 5, 0), 4, 6)
  assert [sorted(s[0]) for s in one] == [sorted(sum(s, [])) for s in four]
  epochs = [sum(sum(one[e * 4:(e + 1) * 4], []), []) for e in (0, 1)]
  assert epochs[0] != epochs[1]  # A new order every epoch.


def test_memory_order_is_the_in_memory_stream(index_shards):
  col = _column(index_shards["arrayrecord"], order="memory")
  x = np.arange(N, dtype=np.float32)[:, None]
  in_memory = stream.train_dataset_fn(x, np.zeros(N, np.int32), BATCH, 5, 2)
  assert (_ids(col.train_dataset_fn(BATCH, 5, 2), 2, 5)
          == _ids(in_memory, 2, 5))


def test_index_shuffle_reads_only_the_records_a_step_uses(index_shards,
                                                          monkeypatch):
  split = _column(index_shards["arrayrecord"])._split  # pylint: disable=protected-access
  asked = []
  read = shard_stream._ArrayRecords.read  # pylint: disable=protected-access
  monkeypatch.setattr(shard_stream._ArrayRecords, "read",  # pylint: disable=protected-access
                      lambda self, i: asked.extend(i.tolist()) or read(self, i))
  fn = shard_stream.train_dataset_fn(split, BATCH, 5, 1000, "index_shuffle")
  it = iter(fn(tf.distribute.InputContext()))
  next(it)
  del it
  # At most what the prefetch buffers hold: a few reads (of a block of
  # batches each), not 1000 steps.
  unit = max(1, shard_stream._BLOCK_RECORDS // BATCH) * BATCH  # pylint: disable=protected-access
  assert BATCH <= len(asked) <= 8 * unit < 1000 * BATCH


# -- ArrayRecord files: written uncompressed; compressed ones still read --


def _compressible():
  """N examples of 1024 floats, example i's input i then zeros: records of
  4 KB that compress to a few bytes."""
  x = np.zeros((N, 1024), np.float32)
  x[:, 0] = np.arange(N)
  y = (np.arange(N) % 2).astype(np.int32)
  return Dataset(x, y, x[:10], y[:10], 2)


def _record_bytes(dataset, manifest):
  """{train file name: the bytes of its records} (ArrayRecord keeps the
  dataset's order)."""
  files = manifest["splits"]["train"]["files"]
  starts = np.cumsum([0] + [f["records"] for f in files])
  return {f["name"]: sum(len(shard_format.encode(dataset.train_x[i],
                                                 dataset.train_y[i]))
                         for i in range(start, start + f["records"]))
          for f, start in zip(files, starts)}


def test_arrayrecord_shards_are_written_uncompressed(tmp_path):
  dataset = _compressible()
  out = _write(dataset, "arrayrecord", str(tmp_path / "new"), num_shards=2)
  manifest = shard_format.read_manifest(out)
  for name, size in _record_bytes(dataset, manifest).items():
    # Compressed, these zeros would take a fraction of it.
    assert os.path.getsize(os.path.join(out, name)) >= size


def test_compressed_arrayrecord_shards_still_read(tmp_path, monkeypatch):
  """Shards written with the riegeli default compression (the writer's
  options before) read the same records through the training input."""
  dataset = _compressible()
  monkeypatch.setattr(shard_format, "ARRAYRECORD_OPTIONS", "group_size:1")
  old = _write(dataset, "arrayrecord", str(tmp_path / "old"), num_shards=2)
  monkeypatch.undo()
  new = _write(dataset, "arrayrecord", str(tmp_path / "new"), num_shards=2)
  manifest = shard_format.read_manifest(old)
  for name, size in _record_bytes(dataset, manifest).items():
    assert os.path.getsize(os.path.join(old, name)) < size  # Compressed.
  col = _column(old)  # Checked against the manifest: counts from footers.
  # The records themselves, through the input's reader, in a random order.
  order = np.random.RandomState(0).permutation(N)
  split = col._split  # pylint: disable=protected-access
  records = shard_stream._ArrayRecords(split.paths, split.counts).read(order)  # pylint: disable=protected-access
  assert [bytes(r) for r in records] == [
      shard_format.encode(dataset.train_x[i], dataset.train_y[i])
      for i in order]
  # An epoch of the training input: every example once, parsed whole, in
  # the order the new shards give.
  fn = col.train_dataset_fn(BATCH, 5, 0)
  it = iter(fn(tf.distribute.InputContext()))
  batches = [next(it) for _ in range(N // BATCH)]
  x = np.concatenate([b[0].numpy() for b in batches])
  y = np.concatenate([b[1].numpy() for b in batches])
  ids = x[:, 0].astype(int)
  assert sorted(ids) == list(range(N))
  np.testing.assert_array_equal(x, dataset.train_x[ids])
  np.testing.assert_array_equal(y, dataset.train_y[ids])
  assert _ids(fn, 2, 2) == _ids(
      _column(new).train_dataset_fn(BATCH, 5, 0), 2, 2)


# -- bad data: one line naming the file, before training --


@pytest.fixture
def digits_copy(index_shards, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "copy")
  shutil.copytree(index_shards["arrayrecord"], out)
  return out


def _error(data_dir):
  with pytest.raises(Exception) as info:
    shards.load(data_dir, 0)
  message = str(info.value)
  assert "\n" not in message
  return message


def test_missing_truncated_and_miscounted_shards_are_named(digits_copy):
  path = os.path.join(digits_copy, "train-00001-of-00004.arrayrecord")
  data = open(path, "rb").read()
  with open(path, "wb") as f:
    f.write(data[:len(data) // 2])
  assert path in _error(digits_copy) and "truncated" in _error(digits_copy)
  os.remove(path)
  assert path in _error(digits_copy) and "cannot be read" in _error(
      digits_copy)


def test_a_manifest_that_disagrees_with_its_files_is_named(digits_copy):
  manifest_path = os.path.join(digits_copy, shard_format.MANIFEST)
  manifest = json.load(open(manifest_path))
  manifest["splits"]["train"]["files"][2]["records"] += 1
  json.dump(manifest, open(manifest_path, "w"))
  assert "train-00002-of-00004.arrayrecord holds 24 records, the manifest " \
         "says 25" in _error(digits_copy)
  manifest["splits"]["train"]["files"][2]["records"] = 0
  json.dump(manifest, open(manifest_path, "w"))
  assert "empty shard" in _error(digits_copy)
  os.remove(manifest_path)
  assert "tools.make_shards" in _error(digits_copy)


def test_a_record_not_matching_the_spec_names_its_file_and_index(tmp_path):
  out, path = _with_records(tmp_path, lambda i: shard_format.encode(
      np.float32([i] * (2 if i == 5 else 1)), np.int32(0)))  # 5: two floats.
  col = shards.load(out, 0).train_x
  it = iter(col.train_dataset_fn(N, 0, 0)(tf.distribute.InputContext()))
  with pytest.raises(tf.errors.InvalidArgumentError) as info:
    next(it)
  assert str(shard_stream.input_error(info.value)) == (
      f"{path}: record 5 {shard_stream.SPEC_ERROR}: its x is not 4 bytes; "
      "make the shards again with tools.make_shards, or pass "
      "--skip_bad_records")



@pytest.mark.timeout(60)
def test_a_file_that_is_not_a_regular_file_is_refused_unopened(digits_copy):
  manifest_path = os.path.join(digits_copy, shard_format.MANIFEST)
  shard = os.path.join(digits_copy, "train-00001-of-00004.arrayrecord")
  os.remove(shard)
  os.mkfifo(shard)  # Opened, it would block: the check comes first.
  assert _error(digits_copy).startswith(
      f"{shard} is not a regular file (a FIFO); the manifest lists it")
  data = open(manifest_path, "rb").read()
  os.remove(manifest_path)
  os.mkfifo(manifest_path)
  assert _error(digits_copy).startswith(
      f"{manifest_path} is not a regular file (a FIFO); ")
  os.remove(manifest_path)
  os.symlink("/dev/zero", manifest_path)  # Read, it would never end.
  assert _error(digits_copy).startswith(
      f"{manifest_path} is not a regular file (a device); ")
  os.remove(manifest_path)
  open(manifest_path, "wb").write(data)
  assert "is not a regular file (a FIFO)" in _error(digits_copy)  # The shard.


@pytest.mark.parametrize("field, value, says", [
    ("num_classes", 10**12, "num_classes 1000000000000 is not an integer"),
    ("num_classes", 0, "num_classes 0 is not an integer"),
    ("num_classes", True, "num_classes True is not an integer"),
    ("x.shape", [8, 8, -1], "the spec of x has shape [8, 8, -1], not a "
     "list of positive integers"),
    ("y.shape", [1.5], "the spec of y has shape [1.5]"),
    ("x.dtype", "float16", "the spec of x is not {dtype: one of"),
    ("y.dtype", "float32", "the spec of y has dtype float32; labels are "
     "class or token ids"),
])
def test_manifest_values_the_input_cannot_use_are_refused_at_load(
    digits_copy, field, value, says):
  manifest_path = os.path.join(digits_copy, shard_format.MANIFEST)
  manifest = json.load(open(manifest_path))
  if "." in field:
    key, attr = field.split(".")
    manifest["spec"][key][attr] = value
  else:
    manifest[field] = value
  json.dump(manifest, open(manifest_path, "w"))
  assert _error(digits_copy).startswith(f"{manifest_path}: {says}")


def test_a_label_outside_num_classes_names_its_file_and_index(tmp_path):
  out, path = _with_records(tmp_path, lambda i: shard_format.encode(
      np.float32([i]), np.int32(7 if i == 5 else 1)))  # num_classes is 2.
  col = shards.load(out, 0).train_x
  it = iter(col.train_dataset_fn(N, 0, 0)(tf.distribute.InputContext()))
  with pytest.raises(tf.errors.InvalidArgumentError) as info:
    next(it)
  assert str(shard_stream.input_error(info.value)) == (
      f"{path}: record 5 {shard_stream.SPEC_ERROR}: its y is outside "
      "[0, num_classes=2); make the shards again with tools.make_shards, or "
      "pass --skip_bad_records")


def _corrupt_record(path, record):
  """Flips a byte inside `record`'s bytes in the (uncompressed) file,
  keeping its size, as a disk would."""
  data = bytearray(open(path, "rb").read())
  at = bytes(data).index(record) + len(record) // 2
  data[at] ^= 0xFF
  open(path, "wb").write(bytes(data))


@pytest.mark.timeout(120)
def test_a_corrupted_arrayrecord_chunk_is_one_line_or_skipped_and_counted(
    digits_copy):
  """A chunk failing its checksum: without --skip_bad_records one line
  naming the file and record; with it, that record alone is dropped and
  counted (the reader that failed is not used again, so the file's other
  records still read), and past --max_bad_records the input stops."""
  split = _column(digits_copy)._split  # pylint: disable=protected-access
  path = split.paths[0]
  record = bytes(shard_stream._ArrayRecords(split.paths, split.counts).read(  # pylint: disable=protected-access
      np.array([5]))[0])
  lost = int(tf.io.decode_raw(tf.io.parse_single_example(record, {
      "x": tf.io.FixedLenFeature([], tf.string)})["x"], tf.float32)[0])
  _corrupt_record(path, record)
  ctx = tf.distribute.InputContext()
  it = iter(_column(digits_copy).train_dataset_fn(N, 5, 0)(ctx))
  with pytest.raises(tf.errors.OpError) as info:
    next(it)
  assert str(shard_stream.input_error(info.value)) == (
      f"{path}: record 5 {shard_stream.CORRUPT_ERROR}; make the shards "
      "again with tools.make_shards, or pass --skip_bad_records")
  for limit in (5, 0):
    options = shards.ShardsOptions(skip_bad_records=True,
                                   max_bad_records=limit)
    col = shards.load(digits_copy, 0, options=options).train_x
    it = iter(col.train_dataset_fn(BATCH, 5, 0)(ctx))
    if limit == 0:
      with pytest.raises(tf.errors.InvalidArgumentError) as info:
        for _ in range(10):
          next(it)
      assert str(shard_stream.input_error(info.value)).startswith(
          f"1 {bad_records.LIMIT_ERROR}=0 in {digits_copy}; ")
      continue
    seen = [int(v) for _ in range(4) for v in next(it)[0].numpy().ravel()]
    # The epoch: every example but the corrupted one, each once.
    assert sorted(seen[:N - 1]) == sorted(set(range(N)) - {lost})
    assert col.skipper.metrics()["data/bad_records"] >= 1


def test_a_corrupted_tfrecord_file_is_one_line(index_shards, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "tfrecord")
  shutil.copytree(index_shards["tfrecord"], out)
  path = os.path.join(out, "train-00000-of-00004.tfrecord")
  record = next(iter(tf.data.TFRecordDataset(path).skip(3))).numpy()
  _corrupt_record(path, record)
  it = iter(_column(out).train_dataset_fn(N, 5, 0)(
      tf.distribute.InputContext()))
  with pytest.raises(tf.errors.DataLossError) as info:
    next(it)
  line = str(shard_stream.input_error(info.value))
  assert line.startswith("a TFRecord shard is corrupted at byte ")
  assert line.endswith("--verify=DIR does); make the shards again with "
                       "tools.make_shards")


@pytest.mark.parametrize("fmt", shard_format.FORMATS)
def test_shard_input_is_not_autotuned_and_frees_at_once(index_shards, fmt):
  import time  # pylint: disable=g-import-not-at-top
  col = _column(index_shards[fmt])
  for ds in (col.train_dataset_fn(BATCH, 5, 0)(tf.distribute.InputContext()),
             col.eval_dataset(4)):
    assert ds.options().autotune.enabled is False
    it = iter(ds)
    next(it)
    start = time.monotonic()
    del it  # Reads in flight finish; nothing sleeps out a round.
    assert time.monotonic() - start < 5


def _with_records(tmp_path, record):
  """TFRecord shards of N examples, train record i being `record(i)`:
  (directory, the train file), the manifest matching the file."""
  x = np.arange(N, dtype=np.float32)[:, None]
  y = np.zeros(N, np.int32)
  out = _write(Dataset(x, y, x[:4], y[:4], 2), "tfrecord",
               str(tmp_path / "bad"), num_shards=1)
  manifest_path = os.path.join(out, shard_format.MANIFEST)
  manifest = json.load(open(manifest_path))
  entry = manifest["splits"]["train"]["files"][0]
  path = os.path.join(out, entry["name"])
  with tf.io.TFRecordWriter(path) as w:
    for i in range(N):
      w.write(record(i))
  entry["bytes"], entry["sha256"] = (os.path.getsize(path),
                                     shard_format.sha256(path))
  json.dump(manifest, open(manifest_path, "w"))
  return out, path


def test_skip_bad_records_counts_them_once_and_stops_past_the_limit(
    tmp_path):
  out, _ = _with_records(tmp_path, lambda i: b"\xff garbage" if i in (
      3, 40, 41) else shard_format.encode(np.float32([i]), np.int32(0)))
  options = shards.ShardsOptions(skip_bad_records=True, max_bad_records=3)
  col = shards.load(out, 0, options=options).train_x
  ctx = tf.distribute.InputContext()
  it = iter(col.train_dataset_fn(BATCH, 0, 0)(ctx))
  seen = [int(v) for _ in range(4) for v in next(it)[0].numpy().ravel()]
  # The first epoch: the good records, none twice; then the next epoch.
  assert set(seen[:N - 3]) == set(range(N)) - {3, 40, 41}
  assert len(set(seen[:N - 3])) == N - 3
  # The first epoch's 3, and what the prefetch has read ahead of it.
  assert col.skipper.metrics()["data/bad_records"] >= 3
  del it
  # An input started again (a resume at step 1, with the count restored)
  # reads from record 24, which the skip of 3 had moved into step 0, and
  # reads 40 and 41 again: not counted twice (6 would be past the limit)...
  again = iter(col.train_dataset_fn(BATCH, 0, 1)(ctx))
  assert [int(v) for _ in range(3) for v in next(again)[0].numpy().ravel()
         ] == [24] + seen[BATCH:-1]
  with pytest.raises(tf.errors.InvalidArgumentError) as info:
    for _ in range(10):  # ...and the second epoch's first is the 4th.
      next(again)
  assert str(shard_stream.input_error(info.value)).startswith(
      f"4 {shard_stream.bad_records.LIMIT_ERROR}=3 in {out}; ")
  assert shards.input_metrics(shards.load(out, 0, options=options)) == {
      "data/bad_records": 0.0}  # Another run's count.


def test_the_ledger_numbers_each_bad_record_once():
  ledger = bad_records.Ledger()
  add = tf.function(lambda places: ledger.add(places), autograph=False)

  def highest(*places):
    return int(add(tf.constant(places, tf.int64)))

  assert [highest(5), highest(7, 9), highest(5), highest(7, 11)] == [
      1, 3, 1, 4]  # 7 keeps its number, 2; 11 is the 4th.
  assert int(ledger.count.numpy()) == 4
  # It remembers the places of the last RECENT: an older one read again
  # is counted again.
  many = range(100, 100 + bad_records.RECENT)
  assert highest(*many) == bad_records.RECENT + 4
  assert highest(5 + 1000 * bad_records.RECENT) == bad_records.RECENT + 5
  assert highest(101) == 6 and highest(5) == bad_records.RECENT + 6


@pytest.mark.timeout(120)
def test_two_data_workers_produce_each_batch_of_the_stream_once(index_shards):
  from dist_loop.data import service  # pylint: disable=g-import-not-at-top
  address, servers = service.start_local(2)
  local = shards.load(index_shards["tfrecord"], 0).train_x
  served = shards.load(index_shards["tfrecord"], 0,
                       options=shards.ShardsOptions(
                           data_service=address)).train_x
  ctx = tf.distribute.InputContext()
  # The first epoch's 9 batches of 10: disjoint, so no two alike.
  expected = [tuple(b[0].numpy().ravel()) for b in
              local.train_dataset_fn(10, 5, 0)(ctx).take(N // 10)]
  it = iter(served.train_dataset_fn(10, 5, 0)(ctx))
  got = [tuple(next(it)[0].numpy().ravel()) for _ in range(4)]
  del it
  assert len(set(got)) == len(got)  # No batch twice: static sharding.
  assert set(got) <= set(expected)  # The stream's own batches.
  del servers


def test_skip_bad_records_over_several_sync_workers_is_refused(
    index_shards, small_config):
  """Each worker of a multi-worker sync or local_sgd run reads its own
  input, and only the chief's count would be checkpointed."""
  from dist_loop import configure  # pylint: disable=g-import-not-at-top
  from dist_loop.runtime.cluster import Cluster  # pylint: disable=g-import-not-at-top
  two = Cluster({"worker": ["a:1", "b:1"]}, "worker", 0)
  flat = dict(dataset="shards", data_dir=index_shards["tfrecord"],
              skip_bad_records=True, train_steps=8)
  for mode in ("sync", "local_sgd"):
    with pytest.raises(UserError, match=f"each of the 2 workers of this "
                       f"--mode={mode} run reads its own input"):
      configure.validate(small_config(mode=mode, **flat), two)
    configure.validate(small_config(mode=mode, **flat), Cluster())
  configure.validate(small_config(**dict(flat, skip_bad_records=False)), two)


def test_a_users_npz_becomes_shards_that_read_back_equal(tmp_path):
  rng = np.random.RandomState(0)
  arrays = {"x_train": rng.rand(30, 4, 4, 1).astype(np.float32),
            "y_train": rng.randint(0, 3, 30), "x_test": rng.rand(
                7, 4, 4, 1).astype(np.float32), "y_test": rng.randint(0, 3, 7)}
  path = str(tmp_path / "mine.npz")
  np.savez(path, **arrays)
  out = _write(shard_writer.from_npz(path), "arrayrecord",
               str(tmp_path / "mine"), num_shards=2)
  loaded = shards.load(out, 0)
  x, y = next(iter(loaded.eval_x.eval_dataset(100)))
  np.testing.assert_array_equal(x.numpy(), arrays["x_test"])
  np.testing.assert_array_equal(y.numpy(), arrays["y_test"])
  assert loaded.num_classes == 3 and loaded.train_x.shape == (30, 4, 4, 1)
  np.savez(path, x_train=arrays["x_train"])
  with pytest.raises(UserError, match="lacks y_train, x_test, y_test"):
    shard_writer.from_npz(path)


def _inputs_of(path):
  """The example ids (inputs) in a TFRecord shard of `index_shards`."""
  return {int(np.frombuffer(tf.train.Example.FromString(r.numpy()).features
                            .feature["x"].bytes_list.value[0], np.float32)[0])
          for r in tf.data.TFRecordDataset(path)}


def test_a_tfrecord_resume_does_not_open_the_files_it_skips(tmp_path):
  # Files of whole blocks (records are read and parsed a block at a time),
  # so the block the resume reads first lies in the one file left.
  per_file = -(-shard_stream._BLOCK_RECORDS // BATCH) * BATCH  # pylint: disable=protected-access
  x = np.arange(4 * per_file, dtype=np.float32)[:, None]
  y = np.zeros(len(x), np.int32)
  out = _write(Dataset(x, y, x[:10], y[:10], 2), "tfrecord",
               str(tmp_path / "copy"), num_shards=4)
  col = _column(out)  # Checked against the manifest now, intact.
  steps = 3 * per_file // BATCH  # 3 whole files.
  whole = _ids(col.train_dataset_fn(BATCH, 5, 0), 1, steps + 1)
  skipped = set(sum((step[0] for step in whole[:steps]), []))
  for name in os.listdir(out):
    path = os.path.join(out, name)
    if name.startswith("train-") and _inputs_of(path) <= skipped:
      with open(path, "wb") as f:  # Unreadable if it were opened.
        f.write(b"\0" * 16)
  assert _ids(col.train_dataset_fn(BATCH, 5, steps), 1, 1) == whole[steps:]
