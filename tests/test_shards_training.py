"""Training from shards equals training from memory: the seed CNN on digits
over 2 devices, the Transformer on text; a run begun in memory resumed on
shards, over 2 devices, equals an uninterrupted run on shards. Bad
records, and TFRecord files too few for the run's input pipelines, are
one line."""

import json
import os
import sys
import sysconfig

import numpy as np
import pytest
import tensorflow as tf

from conftest import read_events, run_launch, run_main
from dist_loop import data, make_config
from dist_loop.data import shard_format, shard_writer
from helpers import initial_and_trained

STEPS = 4


@pytest.fixture(scope="module")
def digits_shards(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("digits") / "shards")
  dataset = data.DATASETS.get("digits")(None, 0, None)
  shard_writer.write(dataset, "arrayrecord", 3, out, 0, {"dataset": "digits"})
  return out


def _config(tmp_path, name, **flat):
  base = dict(workdir=str(tmp_path / name), model="cnn", num_devices=1,
              global_batch_size=32, train_steps=STEPS, optimizer="sgd",
              learning_rate=0.1, steps_per_loop=STEPS, log_every=STEPS,
              eval_every=STEPS, checkpoint_every=STEPS, seed=1)
  base.update(flat)
  return make_config(**base)


def _close(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)) < 1e-5


def test_cnn_on_two_devices_of_shards_equals_one_device_in_memory(
    digits_shards, tmp_path):
  _, memory = initial_and_trained(_config(tmp_path, "m", dataset="digits"),
                                  STEPS)
  _, sharded = initial_and_trained(_config(
      tmp_path, "s", dataset="shards", data_dir=digits_shards,
      shard_order="memory", num_devices=2), STEPS)
  assert _close(memory, sharded)


def test_transformer_on_text_shards_equals_in_memory(tmp_path):
  source = os.path.join(sysconfig.get_paths()["stdlib"], "json",
                        "decoder.py")
  tiny = dict(model="transformer", num_layers=1, d_model=16, num_heads=2,
              mlp_ratio=2, global_batch_size=8, learning_rate=0.5)
  text = dict(dataset="text", data_file=source, seq_len=8)
  loaded = data.load(_config(tmp_path, "t", **text, **tiny), None)
  out = str(tmp_path / "text_shards")
  shard_writer.write(loaded, "arrayrecord", 2, out, 0, {})
  _, memory = initial_and_trained(_config(tmp_path, "tm", **text, **tiny), 3)
  _, sharded = initial_and_trained(_config(
      tmp_path, "ts", dataset="shards", data_dir=out, shard_order="memory",
      **tiny), 3)
  assert _close(memory, sharded)


COMMON = ["--num_devices=2", "--global_batch_size=32", "--optimizer=sgd",
          "--learning_rate=0.1", "--steps_per_loop=2", "--log_every=2",
          "--eval_every=4", "--checkpoint_every=2", "--seed=1"]


def _resumed_equals_whole(tmp_path, first, then, whole):
  """A run of `first` for 2 steps resumed with `then` to 4 ends as a run
  of `whole` for 4 steps."""
  resumed, uninterrupted = str(tmp_path / "resumed"), str(tmp_path / "whole")
  assert run_main(f"--workdir={resumed}", "--train_steps=2", *first,
                  *COMMON)[0] == 0
  code, _, err = run_main(f"--workdir={resumed}", "--train_steps=4", *then,
                          *COMMON)
  assert code == 0, err
  assert run_main(f"--workdir={uninterrupted}", "--train_steps=4", *whole,
                  *COMMON)[0] == 0
  summaries = [json.load(open(os.path.join(w, "summary.json")))
               for w in (resumed, uninterrupted)]
  assert summaries[0]["final_step"] == summaries[1]["final_step"] == 4
  assert summaries[0]["eval_loss"] == pytest.approx(summaries[1]["eval_loss"],
                                                    rel=1e-6)


def test_in_memory_run_resumed_on_shards_equals_uninterrupted(
    digits_shards, tmp_path):
  shards = ["--model=cnn", "--dataset=shards", f"--data_dir={digits_shards}",
            "--shard_order=memory"]
  _resumed_equals_whole(tmp_path, ["--model=cnn", "--dataset=digits"],
                        ["--allow_config_change", *shards], shards)


def test_tfrecord_run_resumed_equals_uninterrupted(tmp_path):
  out = str(tmp_path / "tfrecord")
  # 45 records a file: the resume at record 64 skips a whole file first.
  shard_writer.write(data.DATASETS.get("digits")(None, 0, None), "tfrecord",
                     32, out, 0, {"dataset": "digits"})
  shards = ["--model=mlp", "--dataset=shards", f"--data_dir={out}"]
  _resumed_equals_whole(tmp_path, shards, shards, shards)


def _digits_with_bad_records(tmp_path, num_shards=2, bad=(5,)):
  """TFRecord digits shards whose first file's records `bad` are not
  Examples; returns (directory, that file)."""
  out = str(tmp_path / "bad_shards")
  shard_writer.write(data.DATASETS.get("digits")(None, 0, None), "tfrecord",
                     num_shards, out, 0, {"dataset": "digits"})
  manifest_path = os.path.join(out, "manifest.json")
  manifest = json.load(open(manifest_path))
  entry = manifest["splits"]["train"]["files"][0]
  path = os.path.join(out, entry["name"])
  records = [r.numpy() for r in tf.data.TFRecordDataset(path)]
  for i in bad:
    records[i] = b"not an Example"
  with tf.io.TFRecordWriter(path) as w:
    for r in records:
      w.write(r)
  entry["bytes"] = os.path.getsize(path)
  entry["sha256"] = shard_format.sha256(path)
  json.dump(manifest, open(manifest_path, "w"))
  return out, path


def test_a_bad_record_stops_the_run_in_one_line_or_is_skipped_and_counted(
    tmp_path):
  out, path = _digits_with_bad_records(tmp_path)
  common = ["--dataset=shards", f"--data_dir={out}", "--model=mlp",
            "--global_batch_size=64", "--train_steps=30",
            "--steps_per_loop=10", "--log_every=10", "--eval_every=30",
            "--checkpoint_every=10"]
  stopped = str(tmp_path / "stopped")
  code, _, err = run_main(f"--workdir={stopped}", *common)
  assert code != 0
  lines = [l for l in err.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and path in lines[0]
  skipped = str(tmp_path / "skipped")
  code, _, err = run_main(f"--workdir={skipped}", "--skip_bad_records",
                          *common)
  assert code == 0, err
  summary = json.load(open(os.path.join(skipped, "summary.json")))
  assert summary["bad_records"] >= 1  # Record 5, in every epoch read.
  events = read_events(os.path.join(skipped, "tb"))
  assert max(events["train/data/bad_records"].values()) >= 1


def test_the_bad_record_count_is_the_runs_over_a_resume_in_async_mode(
    tmp_path):
  """One async worker reads the stream of one file in order, 8 records a
  step: records 5 and 32 are bad. Step 3's batch ends past the skip of 5,
  so it reads record 32 before the checkpoint of step 4, and the resumed
  input, which starts at record 4 * 8, reads it again: counted once."""
  out, _ = _digits_with_bad_records(tmp_path, num_shards=1, bad=(5, 32))
  common = ["--mode=async", "--num_devices=1", "--dataset=shards",
            f"--data_dir={out}", "--skip_bad_records", "--model=mlp",
            "--global_batch_size=8", "--optimizer=sgd",
            "--learning_rate=0.1", "--steps_per_loop=4", "--log_every=4",
            "--eval_every=8", "--checkpoint_every=4"]
  resumed, whole = str(tmp_path / "resumed"), str(tmp_path / "whole")
  for workdir, steps in ((resumed, 4), (resumed, 8), (whole, 8)):
    code, _, err = run_main(f"--workdir={workdir}", f"--train_steps={steps}",
                            *common)
    assert code == 0, err
  for workdir in (resumed, whole):
    summary = json.load(open(os.path.join(workdir, "summary.json")))
    assert summary["final_step"] == 8 and summary["bad_records"] == 2
    counts = read_events(os.path.join(workdir, "tb"))[
        "train/data/bad_records"]
    assert counts[max(counts)] == 2



@pytest.mark.timeout(240)
def test_a_corrupted_arrayrecord_shard_stops_in_one_line_or_is_counted(
    digits_shards, tmp_path):
  """Bytes 5000..6000 of a train shard flipped (its size kept): chunks
  that fail their checksum. Without --skip_bad_records one line naming the
  file; with it the run trains, those records alone counted (it never
  spins on a reader that failed)."""
  import shutil  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "corrupted")
  shutil.copytree(digits_shards, out)
  path = os.path.join(out, json.load(open(os.path.join(
      out, "manifest.json")))["splits"]["train"]["files"][0]["name"])
  data = bytearray(open(path, "rb").read())
  data[5000:6000] = bytes(b ^ 0xFF for b in data[5000:6000])
  open(path, "wb").write(bytes(data))
  common = ["--dataset=shards", f"--data_dir={out}", "--model=mlp",
            "--global_batch_size=64", "--train_steps=20",
            "--steps_per_loop=10", "--log_every=10", "--eval_every=20",
            "--checkpoint_every=20"]
  code, _, err = run_main(f"--workdir={tmp_path / 'stopped'}", *common)
  assert code != 0 and "Traceback" not in err, err
  lines = [l for l in err.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and lines[0].startswith(f"error: {path}: record "), err
  skipped = str(tmp_path / "skipped")
  code, _, err = run_main(f"--workdir={skipped}", "--skip_bad_records",
                          *common)
  assert code == 0, err
  # 1000 bytes are at most 4 records' chunks (of ~300 bytes), read at most
  # twice: 20 steps and the prefetch are under 2 epochs. Whole blocks of
  # good records lost uncounted, or a count of the reads of a poisoned
  # reader, are not this.
  count = json.load(open(os.path.join(skipped, "summary.json")))[
      "bad_records"]
  assert 1 <= count <= 8, count

@pytest.fixture(scope="module")
def tfrecord_files(tmp_path_factory):
  """Digits as TFRecord shards: {train files: directory}, 1 and 2."""
  root = tmp_path_factory.mktemp("tfrecord_files")
  digits = data.DATASETS.get("digits")(None, 0, None)
  out = {}
  for n in (1, 2):
    out[n] = str(root / f"files{n}")
    shard_writer.write(digits, "tfrecord", n, out[n], 0, {"dataset": "digits"})
  return out


def _ps_chief_of(num_workers, monkeypatch):
  """This process as the chief of a ps cluster whose other tasks never
  start (nothing connects to them before the trainer is built)."""
  from tools import local_cluster  # pylint: disable=g-import-not-at-top
  spec = local_cluster.cluster_spec(num_workers, 1)
  monkeypatch.setenv("TF_CONFIG", json.dumps(
      {"cluster": spec, "task": {"type": "chief", "index": 0}}))
  monkeypatch.setenv("GRPC_FAIL_FAST", "use_caller")  # The chief sets it.
  return ["--mode=ps", "--join_timeout_s=1"]


@pytest.mark.parametrize("mode", ["async", "ps"])
def test_fewer_tfrecord_files_than_input_pipelines_is_refused_at_start(
    tfrecord_files, tmp_path, monkeypatch, mode):
  """Each input pipeline reads its own TFRecord files: async's 2 worker
  threads in one process, the 2 workers of a ps cluster (its chief reads
  none). One file is refused before the trainer is built, in one line,
  and the refused run leaves no workdir."""
  run = (["--mode=async", "--async_workers=2"] if mode == "async"
         else _ps_chief_of(2, monkeypatch))
  workdir = str(tmp_path / "run")
  common = [*run, "--num_devices=1", "--dataset=shards", "--model=mlp",
            "--global_batch_size=16", "--train_steps=4",
            f"--workdir={workdir}"]
  code, _, err = run_main(*common, f"--data_dir={tfrecord_files[1]}")
  assert code == 1, err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in err, err
  assert lines[0].startswith(
      f"error: {tfrecord_files[1]} has 1 TFRecord train shard for 2 input "
      "pipelines"), err
  assert lines[0].endswith("python -m tools.make_shards --num_shards a "
                           "multiple of 2"), err
  assert not os.path.exists(workdir)
  if mode == "ps":  # 2 files are enough for 2 workers: on to the servers.
    code, _, err = run_main(*common, f"--data_dir={tfrecord_files[2]}")
    assert code == 1 and "did not start within --join_timeout_s=1" in err, err


@pytest.mark.timeout(240)
def test_launch_starts_two_data_workers_that_feed_the_run(tmp_path):
  out = str(tmp_path / "tfrecord")
  shard_writer.write(data.DATASETS.get("digits")(None, 0, None), "tfrecord",
                     2, out, 0, {"dataset": "digits"})
  workdir = str(tmp_path / "run")
  result = run_launch(
      "--num_workers=1", "--num_data_workers=2", "--", sys.executable, "-m",
      "experiments.train", "--dataset=shards", f"--data_dir={out}",
      "--model=mlp", f"--workdir={workdir}", "--train_steps=4",
      "--steps_per_loop=2", "--log_every=2", "--eval_every=4",
      "--checkpoint_every=4", timeout=200)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "--data_service=grpc://localhost:" in open(
      os.path.join(workdir, "flags.txt")).read()
  assert json.load(open(os.path.join(workdir, "summary.json")))[
      "final_step"] == 4
