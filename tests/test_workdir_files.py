"""A workdir whose files are not files: a FIFO, a link to /dev/zero.

A read of a FIFO waits for a writer that never comes, and one of /dev/zero
fills memory until the process is killed; `workdir.check` refuses either by
its kind before anything is read or written. Each run here is a new
process (`conftest.run_train`) with a timeout, so a hang fails the test
instead of stalling it: one `error:` line naming the file, exit 1, and the
workdir exactly as it was, with no lock left behind.
"""

import hashlib
import os
import shutil
import stat

import pytest

from conftest import run_main, run_train

RUN = ["--dataset=synthetic", "--model=mlp", "--global_batch_size=16",
       "--optimizer=sgd", "--steps_per_loop=2", "--log_every=2",
       "--eval_every=100", "--checkpoint_every=2", "--max_checkpoints=5"]
TIMEOUT_S = 60  # A refused run takes a few seconds; a hang, forever.


@pytest.fixture(name="finished", scope="module")
def _finished(tmp_path_factory):
  """A run trained to step 4: ckpt-2 and -4, flags.txt, goodput.jsonl,
  summary.json, tb/. Tests spoil a copy."""
  path = tmp_path_factory.mktemp("finished") / "run"
  code, _, err = run_main(*RUN, f"--workdir={path}", "--train_steps=4")
  assert code == 0, err
  return path


@pytest.fixture(name="run_dir")
def _run_dir(finished, tmp_path):
  shutil.copytree(finished, tmp_path / "run")
  return tmp_path / "run"


def _snapshot(directory):
  """Every path under `directory` with its kind, and a regular file's
  content and mtime (a FIFO is never opened: that would hang here)."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      path = os.path.join(root, name)
      info = os.lstat(path)
      if stat.S_ISREG(info.st_mode):
        with open(path, "rb") as f:
          out[path] = (info.st_mtime_ns, hashlib.sha1(f.read()).digest())
      elif stat.S_ISLNK(info.st_mode):
        out[path] = ("link", os.readlink(path))
      else:
        out[path] = stat.S_IFMT(info.st_mode)
  return out


def _fifo(path):
  if os.path.lexists(path):
    os.unlink(path)
  os.mkfifo(path)


def _dev_zero(path):
  if os.path.lexists(path):
    os.unlink(path)
  os.symlink("/dev/zero", path)


def _refused(workdir, name, kind):
  """A new process on `workdir` is refused in one line naming
  WORKDIR/NAME as `kind`, in time, and leaves `workdir` as it was."""
  before = _snapshot(workdir)
  result = run_train(*RUN, f"--workdir={workdir}", "--train_steps=8",
                     timeout=TIMEOUT_S)
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert result.returncode == 1, result.stderr[-3000:]
  assert len(lines) == 1, result.stderr[-3000:]
  assert lines[0] == (
      f"error: {workdir / name} is not a regular file ({kind}), but a run "
      "reads and writes a file there; move it aside (nothing was changed)")
  assert not result.stdout
  # Nothing rewritten (flags.txt included), and no lock file left behind
  # (the one case whose `lock` is the FIFO keeps that as it was).
  assert _snapshot(workdir) == before
  assert name == "lock" or not os.path.lexists(workdir / "lock")


FILES = ["flags.txt", "goodput.jsonl", "summary.json", "lock",
         "goodput.worker-1.jsonl", "logs/launch.jsonl",
         "checkpoints/checkpoint", "checkpoints/ckpt-4.index",
         "checkpoints/ckpt-4.data-00000-of-00001"]


@pytest.mark.parametrize("name", FILES)
def test_a_fifo_in_place_of_a_file_is_refused_and_untouched(name, run_dir):
  (run_dir / name).parent.mkdir(exist_ok=True)
  _fifo(run_dir / name)
  _refused(run_dir, name, "a FIFO")


@pytest.mark.parametrize("name", ["flags.txt", "goodput.jsonl",
                                  "checkpoints/ckpt-2.index"])
def test_a_link_to_dev_zero_in_place_of_a_file_is_refused(name, run_dir):
  _dev_zero(run_dir / name)
  _refused(run_dir, name, "a symbolic link to /dev/zero, a character device")


@pytest.mark.parametrize("name", ["flags.txt", "goodput.jsonl",
                                  "checkpoints/checkpoint",
                                  "checkpoints/ckpt-1.index"])
def test_a_new_run_into_a_workdir_holding_only_a_fifo_is_refused(name,
                                                                tmp_path):
  run = tmp_path / "run"
  (run / name).parent.mkdir(parents=True)
  _fifo(run / name)
  _refused(run, name, "a FIFO")
