"""tools.make_shards as a user runs it: shards and a manifest that match,
bad input refused in one line with nothing written, and --verify."""

import json
import os

import pytest

from conftest import run_tool
from dist_loop import data
from dist_loop.core.errors import UserError
from dist_loop.data import shard_format, shard_writer, shards


def test_make_shards_writes_a_manifest_its_files_match(tmp_path):
  out = str(tmp_path / "digits")
  result = run_tool("tools.make_shards", "--dataset=digits",
                    "--format=tfrecord", "--num_shards=3", f"--out={out}")
  assert result.returncode == 0, result.stderr[-2000:]
  manifest = json.load(open(os.path.join(out, shard_format.MANIFEST)))
  train = manifest["splits"]["train"]
  counts = [f["records"] for f in train["files"]]
  assert len(counts) == 3 and sum(counts) == train["records"]
  assert max(counts) - min(counts) <= 1  # Balanced: equal per process.
  assert manifest["spec"]["x"] == {"dtype": "float32", "shape": [8, 8, 1]}
  shard_format.check_files(out, manifest, verify_checksums=True)
  assert (f"{out}: {train['records']} train / "
          f"{manifest['splits']['eval']['records']} eval records in 3 "
          "tfrecord shards") in result.stdout
  again = run_tool("tools.make_shards", "--dataset=digits", f"--out={out}")
  assert again.returncode == 2
  assert again.stderr.strip().splitlines() == [
      f"error: --out={out} exists and is not an empty directory; give a "
      "new one"]
  assert sorted(os.listdir(tmp_path)) == ["digits"]  # Nothing else written.


def test_verify_reads_every_checksum_that_a_run_reads_only_on_request(
    tmp_path):
  out = str(tmp_path / "digits")
  shard_writer.write(data.DATASETS.get("digits")(None, 0, None), "tfrecord",
                     2, out, 0, {"dataset": "digits"})
  ok = run_tool("tools.make_shards", f"--verify={out}")
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert ok.stdout.strip().splitlines() == [
      f"{out}: 4 tfrecord shards match the manifest, SHA-256 included"]
  # A byte changed in place: the size is the manifest's, only the
  # checksum tells.
  path = os.path.join(out, shard_format.file_name("train", 1, 2, "tfrecord"))
  with open(path, "r+b") as f:
    f.seek(100)
    byte = f.read(1)
    f.seek(100)
    f.write(bytes([byte[0] ^ 1]))
  bad = run_tool("tools.make_shards", f"--verify={out}")
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines() == [
      f"error: {path} does not match the manifest's SHA-256 (changed since "
      "it was written); make the shards again with tools.make_shards"]
  assert shards.load(out, 0).train_x.shape[0] > 0  # Not read by default.
  with pytest.raises(UserError, match="does not match the manifest's SHA"):
    shards.load(out, 0, options=shards.ShardsOptions(verify_checksums=True))
