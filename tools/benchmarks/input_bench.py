"""The input suite: shards against memory, read alone and in training.

* **read**: each source read alone, examples/s of a 1-device input:
  in-memory digits, TFRecord and ArrayRecord digits shards, ArrayRecord
  text shards.
* **train**: training from shards against training from memory, examples/s
  (the seed CNN on digits, the Transformer on pysource, each from TFRecord
  and from ArrayRecord shards), and their ratio; the target is a ratio of
  at least 0.97.
* **jpeg**: an input-bound pipeline (JPEG records decoded, cropped and
  flipped on the fly) with 1 parallel call, with one per core, and on a
  local tf.data service of 2 workers.
* **rss**: peak RSS of a process training from ArrayRecord shards of two
  sizes (0.5 GB and 4 GB; `--quick`: 5 and 40 MB); the target is a
  difference under 200 MB. Each size trains in a new process, which writes
  its shards first, record by record.

Every timed part times its variants in the same process, interleaved round
by round (`common`'s rule), and reports each variant's median with its
min-max over the rounds (`spread`); train's ratio is taken per round, so
its spread is the ratio's. A read or jpeg variant opens a new iterator
every round and times it from its second batch. RSS is one process per
size: a high-water mark, not a time.

`--quick` shrinks every size: it checks that the suite runs, nothing more.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from dist_loop.data import service, stream
from dist_loop.data import shard_format, shard_writer, shards
from dist_loop.runtime import devices
from tools.benchmarks import common

SIZES = {  # quick -> (batches read a round, train steps a round, rounds,
    #                    jpeg images)
    False: (80, 40, 5, 2048), True: (4, 2, 2, 32)}
# Train steps a round, by model, and train rounds: each round about two
# seconds a variant, so that a round's ratio is not one scheduler hiccup.
TRAIN = {False: ({"cnn": 160, "transformer": 20}, 7),
         True: ({"cnn": 2, "transformer": 2}, 2)}
RSS_BYTES = {False: (2**29, 2**32), True: (5 * 2**20, 40 * 2**20)}
RECORD_FLOATS = 1024  # 4 KB per example in the RSS shards.
BATCH = 64


def _rate(make_iterator, batches: int, batch: int) -> float:
  it = make_iterator()
  next(it)  # Start-up.
  t0 = time.perf_counter()
  for _ in range(batches):
    next(it)
  return batches * batch / (time.perf_counter() - t0)


def _interleaved_rates(sources, batches: int, rounds: int):
  """{name: examples/s of every round} of the iterators `sources` make
  ({name: fn() -> iterator}), timed in turn round by round, each round
  on a new iterator (the previous one's threads stopped)."""
  rates = {name: [] for name in sources}
  for _ in range(rounds):
    for name, make in sources.items():
      rates[name].append(_rate(make, batches, BATCH))
  return rates


def _row(part: str, case: str, rates) -> dict:
  return {"part": part, "case": case,
          "examples/s": statistics.median(rates),
          "spread": common.spread(rates, "{:.0f}"), "rounds": len(rates)}


def _read_rows(root: str, quick: bool):
  batches, rounds = SIZES[quick][0], SIZES[quick][2]
  digits = common.load_data(common.config(dataset="digits", model="mlp"))
  sources = {"memory (digits)": stream.train_dataset_fn(
      digits.train_x, digits.train_y, BATCH, 0)}
  for fmt in shard_format.FORMATS:
    out = os.path.join(root, f"digits_{fmt}")
    shard_writer.write(digits, fmt, 4, out, 0, {"dataset": "digits"})
    sources[f"{fmt} (digits)"] = shards.load(out, 0).train_x.train_dataset_fn(
        BATCH, 0, 0)
  text = _text_shards(root, quick, "arrayrecord")
  sources["arrayrecord (text)"] = shards.load(
      text, 0).train_x.train_dataset_fn(BATCH, 0, 0)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  ctx = tf.distribute.InputContext()
  rates = _interleaved_rates(
      {name: (lambda f=fn: iter(f(ctx))) for name, fn in sources.items()},
      batches, rounds)
  return [_row("read", name, r) for name, r in rates.items()]


def _text_shards(root: str, quick: bool, fmt: str) -> str:
  out = os.path.join(root, f"pysource_{fmt}")
  if not os.path.exists(out):
    flat = dict(dataset="pysource", model="transformer",
                seq_len=32 if quick else 128)
    loaded = common.load_data(common.config(**flat))
    shard_writer.write(loaded, fmt, 4, out, 0, {"dataset": "pysource"})
  return out


def _train_rows(root: str, quick: bool):
  steps_of, rounds = TRAIN[quick]
  names = devices.configure(4, "cpu")[:1]  # As the other suites.
  cases = {}  # Each model from each format's shards (`_read_rows` wrote
  for fmt in shard_format.FORMATS:  # the digits').
    cases[f"cnn on digits, {fmt}"] = (
        dict(dataset="digits", model="cnn"),
        os.path.join(root, f"digits_{fmt}"))
    cases[f"transformer on pysource, {fmt}"] = (
        dict(dataset="pysource", model="transformer",
             seq_len=32 if quick else 128), _text_shards(root, quick, fmt))
  rows = []
  for name, (flat, shard_dir) in cases.items():
    steps = steps_of[flat["model"]]
    base = dict(global_batch_size=BATCH, optimizer="adam",
                steps_per_loop=steps, num_devices=1)
    shard_flat = {k: v for k, v in flat.items()
                  if k not in ("seq_len", "dataset")}
    variants = {"memory": dict(base, **flat),
                "shards": dict(base, **shard_flat, dataset="shards",
                               data_dir=shard_dir)}
    trainers = {}
    for label, v in variants.items():
      _, trainers[label] = common.trainer(names, v)
      trainers[label].train(steps)  # Traces.
    seconds = common.interleaved_times(
        {k: (lambda t=t: t.train(steps)) for k, t in trainers.items()},
        rounds)
    for t in trainers.values():
      t.close()
    # Each round's ratio: the two variants of a round shared its noise.
    ratios = [m / s for m, s in zip(seconds["memory"], seconds["shards"])]
    rows.append({**_row("train", name,
                        [steps * BATCH / s for s in seconds["shards"]]),
                 "vs memory": statistics.median(ratios),
                 "vs memory spread": common.spread(ratios),
                 "target": ">= 0.97"})
  return rows


def _jpeg_rows(root: str, quick: bool):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  count = SIZES[quick][3]
  path = os.path.join(root, "jpeg.tfrecord")
  rng = np.random.RandomState(0)
  with tf.io.TFRecordWriter(path) as w:
    for _ in range(count):
      image = rng.randint(0, 255, (96, 96, 3), dtype=np.uint8)
      w.write(tf.io.encode_jpeg(image).numpy())

  @stream.no_autograph
  def augment(record):
    image = tf.io.decode_jpeg(record, channels=3)
    image = tf.image.random_crop(image, (80, 80, 3))
    return tf.image.random_flip_left_right(image)

  def pipeline(calls, address=None):
    ds = tf.data.TFRecordDataset(path).repeat().map(
        augment, num_parallel_calls=calls).batch(BATCH)
    if address:
      ds = ds.apply(tf.data.experimental.service.distribute(
          processing_mode="parallel_epochs", service=address))
    return stream.without_autotune(ds.prefetch(2))

  batches = max(2, count // BATCH)
  address, servers = service.start_local(2)
  sources = {f"{calls} parallel calls": (lambda c=calls: iter(pipeline(c)))
             for calls in (1, stream.parallel_calls())}
  sources["tf.data service, 2 workers"] = lambda: iter(pipeline(1, address))
  rates = _interleaved_rates(sources, batches, SIZES[quick][2])
  del servers
  return [_row("jpeg", name, r) for name, r in rates.items()]


def _rss_rows(quick: bool):
  rows = []
  for size in RSS_BYTES[quick]:
    with tempfile.TemporaryDirectory() as root:
      result = subprocess.run(
          [sys.executable, "-m", "tools.benchmarks.input_bench", root,
           str(size), str(SIZES[quick][1])], capture_output=True, text=True,
          timeout=3600, check=True)
      rows.append({"part": "rss", "case": f"{size / 2**20:.0f} MB of shards",
                   "peak RSS MB": json.loads(result.stdout.splitlines()[-1])})
  rows[-1]["vs smaller"] = (rows[-1]["peak RSS MB"] - rows[0]["peak RSS MB"])
  rows[-1]["target"] = "< 200 MB"
  return rows


def run(quick: bool = False) -> dict:
  with tempfile.TemporaryDirectory() as root:
    rows = (_read_rows(root, quick) + _train_rows(root, quick)
            + _jpeg_rows(root, quick) + _rss_rows(quick))
  columns = ["part", "case", "examples/s", "spread", "vs memory",
             "vs memory spread", "rounds", "peak RSS MB", "vs smaller",
             "target"]
  return {"rows": rows, "table": common.markdown_table(rows, columns)}


def _write_big_shards(out: str, size: int) -> None:
  """ArrayRecord shards of `size` bytes of float32 examples, written one
  record at a time (never the whole set in memory)."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  count = max(BATCH * 4, size // (RECORD_FLOATS * 4))
  rng = np.random.RandomState(0)
  manifest = {"version": shard_format.VERSION, "format": "arrayrecord",
              "made_from": {"dataset": "input_bench"},
              "task": "classification", "num_classes": 10,
              "spec": {"x": {"dtype": "float32", "shape": [RECORD_FLOATS]},
                       "y": {"dtype": "int32", "shape": []}}, "splits": {}}
  for split, n, files in (("train", count, 4), ("eval", BATCH, 1)):
    entries = []
    for i, rows in enumerate(np.array_split(np.arange(n), files)):
      name = shard_format.file_name(split, i, files, "arrayrecord")
      writer = array_record_module.ArrayRecordWriter(
          os.path.join(out, name), shard_format.ARRAYRECORD_OPTIONS)
      for _ in rows:
        writer.write(shard_format.encode(
            rng.rand(RECORD_FLOATS).astype(np.float32),
            np.int32(rng.randint(10))))
      writer.close()
      path = os.path.join(out, name)
      entries.append({"name": name, "records": len(rows),
                      "bytes": os.path.getsize(path),
                      "sha256": shard_format.sha256(path)})
    manifest["splits"][split] = {"records": n, "files": entries}
  with open(os.path.join(out, shard_format.MANIFEST), "w") as f:
    json.dump(manifest, f)


def _peak_rss_of_training(root: str, size: int, steps: int) -> float:
  """Writes the shards, then trains `steps` from them: the peak RSS (MB)
  the training added to the process after the shards were written."""
  _write_big_shards(root, size)
  names = devices.configure(1, "cpu")  # A process of its own.
  _, trainer = common.trainer(names, dict(
      dataset="shards", data_dir=root, model="mlp", global_batch_size=BATCH,
      optimizer="adam", steps_per_loop=steps))
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # The high-water mark starts again from here.
  trainer.train(steps)
  trainer.close()
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) / 1024 for l in f
                if l.startswith("VmHWM"))


if __name__ == "__main__":
  from dist_loop.runtime import console  # pylint: disable=g-import-not-at-top
  console.start(0)
  print(json.dumps(_peak_rss_of_training(sys.argv[1], int(sys.argv[2]),
                                         int(sys.argv[3]))))
