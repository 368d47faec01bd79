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


def _bad_inputs(tmp_path):
  """A FIFO, a regular file and a directory next to each other."""
  os.mkfifo(tmp_path / "fifo")
  (tmp_path / "file").write_text("x")
  (tmp_path / "dir").mkdir()
  return str(tmp_path)


@pytest.mark.parametrize("args, line", [
    (["--dataset=npz", "--npz={t}/fifo", "--out={t}/o"],
     "error: --npz={t}/fifo is not a regular file (a device, a pipe or a "
     "socket); pass an .npz file"),
    (["--dataset=npz", "--npz={t}/dir", "--out={t}/o"],
     "error: --npz={t}/dir is a directory; pass an .npz file"),
    (["--dataset=digits", "--out={t}/file/a/s"],
     "error: --out={t}/file/a/s: {t}/file is not a directory; give a path "
     "under a directory"),
    (["--dataset=digits", "--out=/proc/no_such_process/s"],
     "error: --out=/proc/no_such_process/s cannot be written (No such file "
     "or directory); give a directory you can write to"),
    (["--verify={t}/dir"], "error: --verify={t}/dir holds no manifest.json; "
     "pass a directory written by tools.make_shards"),
    (["--verify={t}/file"], "error: --verify={t}/file is not a directory; "
     "pass a directory written by tools.make_shards"),
    (["--verify={t}/none"], "error: --verify={t}/none does not exist; pass a "
     "directory written by tools.make_shards"),
])
def test_bad_paths_are_one_line_naming_the_flag_and_write_nothing(
    tmp_path, args, line):
  t = _bad_inputs(tmp_path)
  result = run_tool("tools.make_shards", *[a.format(t=t) for a in args],
                    timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [line.format(t=t)]
  assert sorted(os.listdir(tmp_path)) == ["dir", "fifo", "file"]


def test_verify_refuses_a_pipe_in_place_of_the_manifest_or_a_shard(tmp_path):
  out = str(tmp_path / "digits")
  shard_writer.write(data.DATASETS.get("digits")(None, 0, None), "tfrecord",
                     1, out, 0, {"dataset": "digits"})
  path = os.path.join(out, shard_format.file_name("eval", 0, 1, "tfrecord"))
  os.remove(path)
  os.mkfifo(path)
  shard = run_tool("tools.make_shards", f"--verify={out}", timeout=120)
  assert shard.returncode == 2
  assert shard.stderr.strip().splitlines() == [
      f"error: {path} is not a regular file (a device, a pipe or a socket); "
      "make the shards again with tools.make_shards"]
  manifest = os.path.join(out, shard_format.MANIFEST)
  os.remove(manifest)
  os.mkfifo(manifest)
  listed = run_tool("tools.make_shards", f"--verify={out}", timeout=120)
  assert listed.returncode == 2
  assert listed.stderr.strip().splitlines() == [
      f"error: {manifest} is not a regular file (a device, a pipe or a "
      "socket); make the shards again with tools.make_shards"]
