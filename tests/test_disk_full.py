"""A full disk: every write that fails is one line, and nothing is lost.

Saving a checkpoint, writing TensorBoard events and writing the lock's PID
each fail with one `UserError` that says what could not be written and which
checkpoint a rerun resumes from; a failed save leaves no `*_temp` directory
or partial file; a refused run leaves no new workdir; freeing space and
rerunning the same command resumes.

Each case runs on a real full disk, a small tmpfs mounted for the test
(tests run as root; skipped only where mounting is impossible), and on a
stub whose writes under the directory raise ENOSPC where TensorFlow and the
operating system would, so the behaviour is tested everywhere. The run that
trains runs once, on the tmpfs, or on the stub where there is none.
"""

import errno
import logging
import os
import subprocess

import pytest
import tensorflow as tf
from tensorflow.python.ops import summary_ops_v2

from conftest import run_main
from dist_loop import train
from dist_loop.core.errors import UserError
from dist_loop.runtime import checkpoints, lock
from dist_loop.runtime.summaries import Summaries

ENOSPC = os.strerror(errno.ENOSPC)  # "No space left on device"
RUN = ["--dataset=synthetic", "--model=mlp", "--global_batch_size=16",
       "--optimizer=sgd", "--steps_per_loop=2", "--log_every=2",
       "--eval_every=100", "--checkpoint_every=2"]


class Disk:
  """A directory whose filesystem can be filled up and freed again."""

  def __init__(self, root, monkeypatch):
    self.root = str(root)
    self.full = False
    self._monkeypatch = monkeypatch

  def fill(self):
    self.full = True

  def free(self):
    self.full = False

  def holds(self, path) -> bool:
    return os.path.abspath(str(path)).startswith(self.root + os.sep)


class Tmpfs(Disk):
  """A real tmpfs of a few MB; `fill` writes a file until the disk is full."""

  def __init__(self, root, monkeypatch):
    super().__init__(root, monkeypatch)
    os.makedirs(self.root)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m",
                              "tmpfs", self.root], capture_output=True,
                             text=True, timeout=30)
    # Why not, when mounting is impossible (not root, no CAP_SYS_ADMIN).
    self.refused = mounted.stderr.strip() if mounted.returncode else None
    self._filler = os.path.join(self.root, "filler")

  def fill(self):
    super().fill()
    with open(self._filler, "ab", buffering=0) as f:
      for chunk in (1 << 20, 1 << 16, 1 << 12, 1):
        try:
          while True:
            f.write(b"\0" * chunk)
        except OSError as e:
          assert e.errno == errno.ENOSPC, e

  def free(self):
    super().free()
    os.unlink(self._filler)

  def unmount(self):
    if subprocess.run(["umount", self.root], capture_output=True,
                      timeout=30).returncode:
      subprocess.run(["umount", "-l", self.root], capture_output=True,
                     timeout=30)


class Stub(Disk):
  """A plain directory whose writes raise ENOSPC while it is "full": the
  operating system's for the lock's PID and the workdir's small files, and
  TensorFlow's for checkpoints (after leaving what SaveV2 leaves) and
  events."""

  def __init__(self, root, monkeypatch):
    super().__init__(root, monkeypatch)
    os.makedirs(self.root)
    patch = monkeypatch.setattr
    real_write, real_fsync = os.write, os.fsync
    patch(os, "write", lambda fd, data: self._os(real_write, fd, data))
    patch(os, "fsync", lambda fd: self._os(real_fsync, fd))
    real_save = tf.train.Checkpoint._write  # pylint: disable=protected-access

    def save(checkpoint, prefix, *args, **kwargs):
      if self.full and self.holds(prefix):
        os.makedirs(prefix + "_temp")  # What TensorFlow leaves behind.
        with open(prefix + "_temp/part-00000-of-00001.index", "wb") as f:
          f.write(b"\1")
        raise tf.errors.ResourceExhaustedError(
            None, None, f"{prefix}.index; {ENOSPC} [Op:MergeV2Checkpoints]")
      return real_save(checkpoint, prefix, *args, **kwargs)

    patch(tf.train.Checkpoint, "_write", save)
    for name in ("scalar", "histogram", "image"):
      patch(tf.summary, name, self._events(getattr(tf.summary, name)))
    patch(summary_ops_v2._ResourceSummaryWriter, "flush",  # pylint: disable=protected-access
          self._events(summary_ops_v2._ResourceSummaryWriter.flush))  # pylint: disable=protected-access

  def _os(self, real, fd, *args):
    if self.full and self.holds(os.readlink(f"/proc/self/fd/{fd}")):
      raise OSError(errno.ENOSPC, ENOSPC)
    return real(fd, *args)

  def _events(self, real):
    def write(*args, **kwargs):
      if self.full:
        raise tf.errors.ResourceExhaustedError(
            None, None, f"{self.root}/tb/events.out.tfevents; {ENOSPC}\n\t"
            "Failed to flush 11 events")
      return real(*args, **kwargs)
    return write


def _mounted(root, monkeypatch):
  """A Tmpfs at `root`, or None where one cannot be mounted."""
  disk = Tmpfs(root, monkeypatch)
  if disk.refused is None:
    return disk
  os.rmdir(root)
  return None


@pytest.fixture(name="disk", params=["tmpfs", "stub"])
def _disk(request, tmp_path, monkeypatch):
  """Each variant: the cases that cost no training run on both."""
  if request.param == "stub":
    yield Stub(tmp_path / "disk", monkeypatch)
    return
  disk = _mounted(tmp_path / "disk", monkeypatch)
  if disk is None:
    pytest.skip("cannot mount a tmpfs here; the stub variant covers it")
  try:
    yield disk
  finally:
    disk.unmount()


@pytest.fixture(name="real_or_stub_disk")
def _real_or_stub_disk(tmp_path, monkeypatch):
  """A tmpfs, or the stub where mounting is impossible: for the case that
  trains, which runs once."""
  disk = _mounted(tmp_path / "disk", monkeypatch)
  if disk is None:
    yield Stub(tmp_path / "disk", monkeypatch)
    return
  try:
    yield disk
  finally:
    disk.unmount()


def _entries(directory):
  return sorted(os.listdir(directory))


def _items(value):
  return {"step": tf.Variable(0, dtype=tf.int64),
          "w": tf.Variable(tf.fill([256], value))}


def test_a_refused_run_on_a_full_disk_creates_no_workdir(disk):
  disk.fill()
  workdir = os.path.join(disk.root, "run")
  code, out, err = run_main(*RUN, f"--workdir={workdir}", "--train_steps=2")
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 1, (out, err)
  assert lines == [
      f"error: cannot write this run's PID into the lock file {workdir}/lock "
      f"({ENOSPC}); nothing was written, and there is no checkpoint yet. Free "
      "some space, then rerun the same command"]
  assert not os.path.exists(workdir)


def test_the_lock_of_a_workdir_with_checkpoints_names_the_newest(disk):
  workdir = os.path.join(disk.root, "run")
  checkpoints.Checkpointer(_items(1.0), workdir, 3).save(7)
  before = _entries(os.path.join(workdir, "checkpoints"))
  disk.fill()
  with pytest.raises(UserError, match=f"the newest checkpoint, {workdir}/"
                     "checkpoints/ckpt-7, is intact"):
    lock.Lock(workdir).acquire()
  assert _entries(workdir) == ["checkpoints"]  # No lock file left.
  assert _entries(os.path.join(workdir, "checkpoints")) == before


def test_a_checkpoint_that_cannot_be_saved_leaves_nothing_of_itself(disk):
  workdir = os.path.join(disk.root, "run")
  directory = os.path.join(workdir, "checkpoints")
  items = _items(1.0)
  saver = checkpoints.Checkpointer(items, workdir, max_to_keep=3)
  saver.save(1)
  before = _entries(directory)
  items["w"].assign(tf.fill([256], 2.0))
  disk.fill()
  with pytest.raises(UserError) as info:
    saver.save(2)
  assert str(info.value) == (
      f"cannot write the checkpoint of step 2 in {directory} ({ENOSPC}); "
      f"what was written of it is removed, and the newest checkpoint, "
      f"{directory}/ckpt-1, is intact. Free some space (or fix the "
      "directory's permissions), then rerun the same command to resume from "
      "there")
  assert _entries(directory) == before  # No ckpt-2_temp, no ckpt-2.*.
  assert saver.saved_step == 1
  assert tf.train.latest_checkpoint(directory) == f"{directory}/ckpt-1"
  disk.free()
  assert saver.save(2) == f"{directory}/ckpt-2"
  state = tf.train.get_checkpoint_state(directory)
  assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [
      "ckpt-1", "ckpt-2"]
  fresh = _items(0.0)
  checkpoints.Checkpointer(fresh, workdir, 3).restore(
      tf.distribute.get_strategy().scope())
  assert float(fresh["w"][0]) == 2.0


def test_a_worker_that_cannot_save_leaves_no_temporary_directory(disk):
  workdir = os.path.join(disk.root, "run")
  directory = os.path.join(workdir, "checkpoints")
  checkpoints.Checkpointer(_items(1.0), workdir, 3).save(4)
  worker = checkpoints.Checkpointer(_items(1.0), workdir, 3, is_chief=False,
                                    task_index=1)
  disk.fill()
  with pytest.raises(UserError, match=f"the newest checkpoint, {directory}/"
                     "ckpt-4, is intact"):
    worker.save(6)
  assert "workertemp_1" not in _entries(directory)
  disk.free()
  worker.save(6)  # Written to its own directory, and that deleted again.
  assert "workertemp_1" not in _entries(directory)


def test_tensorboard_events_that_cannot_be_written(disk):
  workdir = os.path.join(disk.root, "run")
  checkpoints.Checkpointer(_items(1.0), workdir, 3).save(3)
  saved = _entries(os.path.join(workdir, "checkpoints"))
  summaries = Summaries(workdir)
  summaries.scalars(1, {"train/loss": 1.0})
  summaries.flush()
  disk.fill()
  with pytest.raises(UserError) as info:
    for step in range(2, 200):  # Past the writer's queue of 10 events.
      summaries.scalars(step, {"train/loss": 1.0, "eval/loss": 2.0})
    summaries.flush()
  assert str(info.value) == (
      f"cannot write TensorBoard events under {workdir}/tb ({ENOSPC}); the "
      f"newest checkpoint, {workdir}/checkpoints/ckpt-3, is intact. Free "
      "some space, then rerun the same command to resume")
  # The run's clean-up goes on without raising over that error.
  summaries.scalars(300, {"train/loss": 1.0})
  summaries.flush()
  summaries.close()
  assert _entries(os.path.join(workdir, "checkpoints")) == saved


def test_a_run_that_fills_the_disk_resumes_once_there_is_space(
    real_or_stub_disk, small_config, monkeypatch, caplog):
  disk = real_or_stub_disk
  cfg = small_config(workdir=os.path.join(disk.root, "run"), train_steps=4,
                     steps_per_loop=2, log_every=2, checkpoint_every=2,
                     eval_every=100)
  train.run(cfg)
  directory = os.path.join(cfg.workdir, "checkpoints")
  saved = {name: open(os.path.join(directory, name), "rb").read()
           for name in _entries(directory) if name.startswith("ckpt-")}
  real_save = checkpoints.Checkpointer.save
  filled = []

  def fill_at_step_6(self, step):
    if step == 6 and not filled:
      filled.append(step)
      disk.fill()
    return real_save(self, step)

  monkeypatch.setattr(checkpoints.Checkpointer, "save", fill_at_step_6)
  with pytest.raises(UserError) as info:
    train.run(cfg.replace(train_steps=8))
  # The checkpoint, or the events flushed after it: either names the disk's
  # words and the checkpoint a rerun starts from.
  assert f"({ENOSPC})" in str(info.value)
  assert (f"the newest checkpoint, {directory}/ckpt-4, is intact"
          in str(info.value))
  assert not [n for n in _entries(directory)
              if "_temp" in n or "ckpt-6" in n or n.startswith("checkpoint.")]
  assert tf.train.latest_checkpoint(directory) == f"{directory}/ckpt-4"
  assert all(open(os.path.join(directory, name), "rb").read() == data
             for name, data in saved.items())
  assert not os.path.exists(os.path.join(cfg.workdir, "lock"))
  disk.free()
  caplog.set_level(logging.INFO, logger="absl")
  summary = train.run(cfg.replace(train_steps=8))
  assert summary["final_step"] == 8
  assert f"Resumed from {directory}/ckpt-4." in caplog.text
