"""dist_loop/runtime/files.py: crash-safe writes, and the words of a failed one."""

import errno
import json
import os

import pytest
import tensorflow as tf

from dist_loop.runtime import files


def _full_disk(*args, **kwargs):
  del args, kwargs
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_write_creates_the_directory_and_replaces_the_old_file(tmp_path):
  path = tmp_path / "new" / "flags.txt"
  files.atomic_write_text(str(path), "--a=1\n")
  assert path.read_text() == "--a=1\n"
  files.atomic_write_text(str(path), "--a=2\n")
  assert path.read_text() == "--a=2\n"
  assert os.listdir(path.parent) == ["flags.txt"]  # No temporary file.


def test_json_is_sorted_indented_and_ends_with_a_newline(tmp_path):
  path = tmp_path / "summary.json"
  files.atomic_write_json(str(path), {"b": 1, "a": [1.5, None]})
  text = path.read_text()
  assert text == '{\n  "a": [\n    1.5,\n    null\n  ],\n  "b": 1\n}\n'
  assert json.loads(text) == {"a": [1.5, None], "b": 1}


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path, monkeypatch):
  path = tmp_path / "summary.json"
  path.write_text("old\n")
  monkeypatch.setattr(files.os, "fsync", _full_disk)
  with pytest.raises(OSError) as info:
    files.atomic_write_text(str(path), "new\n")
  assert info.value.errno == errno.ENOSPC
  assert path.read_text() == "old\n"
  assert os.listdir(tmp_path) == ["summary.json"]


def test_a_directory_in_the_targets_place_is_an_oserror(tmp_path):
  (tmp_path / "flags.txt").mkdir()
  with pytest.raises(OSError):
    files.atomic_write_text(str(tmp_path / "flags.txt"), "x")
  assert os.listdir(tmp_path) == ["flags.txt"]
  assert (tmp_path / "flags.txt").is_dir()


def test_a_directory_that_cannot_be_synced_still_gets_the_file(
    tmp_path, monkeypatch):
  real_fsync = os.fsync

  def no_directory_sync(fd):
    if os.path.isdir(f"/proc/self/fd/{fd}"):
      raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    real_fsync(fd)

  monkeypatch.setattr(files.os, "fsync", no_directory_sync)
  files.atomic_write_text(str(tmp_path / "a.txt"), "kept\n")
  assert (tmp_path / "a.txt").read_text() == "kept\n"


@pytest.mark.parametrize("error, expected", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/x/flags.txt"),
     "No space left on device"),
    (tf.errors.ResourceExhaustedError(
        None, None, "{{function_node __wrapped__MergeV2Checkpoints_device_/"
        "job:localhost/replica:0/task:0/device:CPU:0}} /run/checkpoints/"
        "ckpt-3.index; No space left on device [Op:MergeV2Checkpoints]"),
     "No space left on device"),
    (tf.errors.ResourceExhaustedError(
        None, None, "{{function_node __wrapped__WriteSummary_device_/job:"
        "localhost/replica:0/task:0/device:CPU:0}} /run/tb/events.out; No "
        "space left on device\n\tFailed to flush 11 events to /run/tb/events"
        ".out\n\tCould not flush events file."), "No space left on device"),
    (tf.errors.PermissionDeniedError(None, None, "/ro/ckpt-1_temp; "
                                     "Read-only file system"),
     "Read-only file system"),
    (RuntimeError("something else entirely"), "something else entirely"),
])
def test_the_reason_is_the_operating_systems_words(error, expected):
  assert files.reason(error) == expected
