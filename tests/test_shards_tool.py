"""tools.make_shards as a user runs it: shards and a manifest that match,
and bad input refused in one line with nothing written."""

import json
import os

from conftest import run_tool
from dist_loop.data import shard_format


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
