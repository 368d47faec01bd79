"""Faults: non-finite values, corrupt checkpoints, config drift, signals.

The rule under test: a run never loses more than a checkpoint interval,
never reads a half-written file, never hangs, and resumes to the same
variables as a run that was never interrupted.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config  # pylint: disable=g-direct-tensorflow-import

from conftest import REPO, checkpoint_variables, max_diff, run_main
from dist_loop import checkpoints, make_config, train
from dist_loop.data import stream
from dist_loop.data.base import DATASETS, Dataset
from dist_loop.errors import NonFiniteError, UserError
from dist_loop.modes import sync
from dist_loop.modes.asynchronous.trainer import AsyncTrainer
from dist_loop.modes.pipeline import PipelineTrainer

NAN_EXAMPLES = 640
BATCH = 32


@DATASETS.register("test_one_nan")
def _one_nan(data_dir, seed, image_size=None):
  """Finite data but for example 0, which is NaN."""
  del data_dir, seed, image_size
  rng = np.random.RandomState(0)
  x = rng.randn(NAN_EXAMPLES, 10).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  x[0] = np.nan
  return Dataset(x, y, x[1:65], y[1:65], 10)


def _nan_step(seed=0):
  """The 1-based step whose global batch first holds example 0."""
  index = np.arange(NAN_EXAMPLES)
  ds = stream.train_dataset_fn(index, index, BATCH, seed)(
      tf.distribute.InputContext(1, 0, 1))
  for step, (xb, _) in enumerate(ds.take(NAN_EXAMPLES // BATCH), start=1):
    if 0 in xb.numpy():
      return step
  raise AssertionError("example 0 is in every epoch")


def test_raise_names_the_step(small_config):
  k = _nan_step()
  cfg = small_config(dataset="test_one_nan", num_devices=2, train_steps=20,
                     global_batch_size=BATCH)
  with pytest.raises(NonFiniteError, match=f"at step {k}\\b"):
    train.run(cfg)


def test_skip_drops_the_step_on_every_replica(small_config):
  cfg = small_config(dataset="test_one_nan", num_devices=2, train_steps=20,
                     global_batch_size=BATCH, nonfinite="skip")
  summary = train.run(cfg)
  assert summary["final_step"] == 20
  assert summary["skipped_steps"] == 1
  assert all(np.isfinite(v).all() for v in checkpoint_variables(cfg))


def test_rollback_gives_up_after_max_rollbacks(small_config):
  # The NaN is in the data, so every replay meets it again.
  cfg = small_config(dataset="test_one_nan", train_steps=20,
                     global_batch_size=BATCH, nonfinite="rollback",
                     max_rollbacks=2, checkpoint_every=2, steps_per_loop=2,
                     log_every=2)
  with pytest.raises(UserError, match="after 2 rollbacks"):
    train.run(cfg)


# Every mode that can roll back; async with one worker, whose updates are
# sequential SGD, so that the two runs can be compared exactly.
ROLLBACK_MODES = {
    "sync": (sync.SyncTrainer, dict(num_devices=2)),
    "pipeline": (PipelineTrainer, dict(mode="pipeline", num_devices=2,
                                       num_stages=2, num_microbatches=2)),
    "async": (AsyncTrainer, dict(mode="async", num_devices=1,
                                 async_workers=1)),
}


@pytest.mark.parametrize("mode", sorted(ROLLBACK_MODES))
def test_transient_nonfinite_rollback_equals_uninterrupted(
    small_config, tmp_path, monkeypatch, mode):
  trainer_class, extra = ROLLBACK_MODES[mode]
  common = dict(train_steps=12, checkpoint_every=4, steps_per_loop=2,
                log_every=2, optimizer="adam", learning_rate=0.01,
                nonfinite="rollback", **extra)
  clean = small_config(workdir=str(tmp_path / "clean"), **common)
  train.run(clean)
  original = trainer_class.train
  calls = []

  def flaky(self, n):  # The 4th inner loop (steps 7-8) fails once, after
    calls.append(n)    # its updates were applied: they must be undone.
    if len(calls) == 4:
      original(self, n)
      if mode == "async":
        self.close()  # As AsyncTrainer.train does before it raises.
      raise NonFiniteError(int(self.step.numpy()))
    return original(self, n)

  monkeypatch.setattr(trainer_class, "train", flaky)
  faulty = small_config(workdir=str(tmp_path / "faulty"), **common)
  summary = train.run(faulty)
  assert summary["rollbacks"] == 1 and summary["final_step"] == 12
  assert max_diff(checkpoint_variables(clean),
                  checkpoint_variables(faulty)) <= 1e-6


def test_corrupt_latest_checkpoint_falls_back(small_config, tmp_path,
                                              monkeypatch):
  common = dict(optimizer="adam", learning_rate=0.01, checkpoint_every=2,
                steps_per_loop=2, log_every=2, max_checkpoints=5)
  whole = small_config(workdir=str(tmp_path / "whole"), train_steps=8,
                       **common)
  train.run(whole)
  part = small_config(workdir=str(tmp_path / "part"), train_steps=6, **common)
  train.run(part)
  data_file = os.path.join(part.workdir, "checkpoints",
                           "ckpt-6.data-00000-of-00001")
  with open(data_file, "r+b") as f:
    f.truncate(os.path.getsize(data_file) // 2)
  restored = []  # (path, the step counter right after the restore)
  real_restore = checkpoints.Checkpointer.restore

  def spy(self, scope):
    path = real_restore(self, scope)
    restored.append((path, int(self.items["step"].numpy())))
    return path

  monkeypatch.setattr(checkpoints.Checkpointer, "restore", spy)
  summary = train.run(part.replace(train_steps=8))
  # It resumed from ckpt-4 (a restart from step 0 would end the same).
  assert restored == [(os.path.join(part.workdir, "checkpoints", "ckpt-4"),
                       4)]
  assert summary["final_step"] == 8
  assert max_diff(checkpoint_variables(whole),
                  checkpoint_variables(part)) <= 1e-6


def test_a_runtime_error_anywhere_in_the_run_is_explained_by_the_mode(
    small_config, monkeypatch):
  # Not only in `train`: a peer can be lost in a checkpoint, an evaluation
  # or the controller's read of the step. Here, the evaluation.
  from dist_loop import evaluation  # pylint: disable=g-import-not-at-top

  def lost(self):
    del self
    raise tf.errors.UnavailableError(None, None, "Socket closed")

  monkeypatch.setattr(evaluation.Evaluator, "evaluate", lost)
  cfg = small_config(train_steps=2, steps_per_loop=2, log_every=2)
  # One process: nothing to explain, so the error goes through unchanged.
  with pytest.raises(tf.errors.UnavailableError):
    train.run(cfg)
  monkeypatch.setattr(
      sync.SyncTrainer, "cluster_error",
      classmethod(lambda cls, config, cluster, e: UserError(
          f"explained: {e.message}")))
  with pytest.raises(UserError, match="explained: Socket closed"):
    train.run(cfg.replace(workdir=cfg.workdir + "_2"))


def test_layout_change_is_refused_unless_allowed(small_config):
  cfg = small_config(train_steps=2, steps_per_loop=2, log_every=2)
  train.run(cfg)
  with open(os.path.join(cfg.workdir, "flags.txt")) as f:
    before = f.read()
  with pytest.raises(UserError, match="--num_devices: 1 -> 2"):
    train.run(cfg.replace(num_devices=2, train_steps=4))
  with open(os.path.join(cfg.workdir, "flags.txt")) as f:
    assert f.read() == before  # Refused before touching anything.
  summary = train.run(cfg.replace(num_devices=2, train_steps=4,
                                  allow_config_change=True))
  assert summary["final_step"] == 4
  # Other flags (here the schedule) may change freely.
  train.run(cfg.replace(num_devices=2, train_steps=6, log_every=3,
                        allow_config_change=True).replace(
                            allow_config_change=False))


# The signals' chain: sharded state (ZeRO-2) on two devices, --deterministic.
SIGNAL_STEPS = 30
SIGNAL_RUN = dict(dataset="synthetic", model="mlp", global_batch_size=32,
                  optimizer="adam", learning_rate=0.01, steps_per_loop=5,
                  log_every=5, checkpoint_every=5, eval_every=1000, seed=0,
                  num_devices=2, shard="gradients", max_checkpoints=100)


def _start(workdir, *extra):
  args = [sys.executable, "-m", "experiments.train",
          *[f"--{k}={v}" for k, v in SIGNAL_RUN.items()],
          f"--train_steps={SIGNAL_STEPS}", "--deterministic",
          f"--workdir={workdir}", *extra]
  return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


def _latest(workdir):
  return tf.train.latest_checkpoint(str(workdir / "checkpoints"))


def _wait_for_checkpoint(workdir, proc, after=None, timeout=300):
  """Until a checkpoint other than `after` is the latest."""
  deadline = time.time() + timeout
  while _latest(workdir) in (None, after):
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    assert time.time() < deadline, "no checkpoint appeared"
    time.sleep(0.05)
  return _latest(workdir)


class _KillAtCheckpoint(threading.Thread):
  """SIGKILLs `proc` once it saved a checkpoint, watching from a thread so
  that this process can train meanwhile (the main thread keeps signals)."""

  def __init__(self, workdir, proc):
    super().__init__(daemon=True)
    self.workdir, self.proc, self.error = workdir, proc, None
    self.start()

  def run(self):
    try:
      _wait_for_checkpoint(self.workdir, self.proc)
    except AssertionError as e:
      self.error = e
    finally:
      self.proc.kill()

  def wait(self):
    self.join(timeout=330)  # Past the checkpoint wait's own bound.
    assert not self.is_alive(), "the watcher did not end"
    if self.error is not None:
      raise self.error


def test_sigkill_then_sigterm_then_resume_equals_uninterrupted(tmp_path):
  """One workdir, two processes: SIGKILLed between checkpoints with shards
  on every device and nothing flushed (no handler, no cleanup, maybe
  mid-write); rerun, it resumes (full tensors, cut again: sharding/state.py)
  and gets SIGTERM, so it saves and exits with the variables of a run never
  interrupted (trained here, with the same op determinism, while the first
  process starts); rerun again (here too), it finishes."""
  workdir, whole = tmp_path / "run", tmp_path / "whole"
  # Slowed down (sleeps only, same updates), so the signals land mid-run.
  proc = _start(workdir, "--straggler=0:20")
  try:
    killer = _KillAtCheckpoint(workdir, proc)
    try:  # Op determinism is process-wide: off again after this run.
      train.run(make_config(workdir=str(whole), train_steps=SIGNAL_STEPS,
                            deterministic=True, **SIGNAL_RUN))
    finally:
      tf_config.disable_op_determinism()
    killer.wait()
  finally:
    proc.kill()
    proc.communicate(timeout=30)
  killed_at = _latest(workdir)
  # The grace period is the watchdog's bound (it ends the process with 143
  # too, but without saving): generous, so only a hang would reach it.
  proc = _start(workdir, "--straggler=0:20", "--grace_period_s=60")
  try:
    _wait_for_checkpoint(workdir, proc, after=killed_at)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 143, err[-2000:]
  assert "Traceback" not in err
  assert f"Resumed from {killed_at}." in err, err[-2000:]
  assert "SIGTERM at step " in err, err[-2000:]
  step = int(err.split("SIGTERM at step ")[1].split(";")[0])
  start = int(killed_at.rsplit("-", 1)[1])
  assert start < step < SIGNAL_STEPS and step % 5 == 0
  assert _latest(workdir).endswith(f"ckpt-{step}")
  # Rerunning resumes from there (in this process, without op determinism,
  # which is process-wide).
  code, out, err = run_main(f"--flagfile={workdir / 'flags.txt'}",
                            "--nodeterministic", "--straggler=")
  assert code == 0, err
  assert f"done: step {SIGNAL_STEPS}" in out
  assert _latest(workdir).endswith(f"ckpt-{SIGNAL_STEPS}")
  config = make_config(workdir=str(workdir), **SIGNAL_RUN)
  path = f"checkpoints/ckpt-{step}"
  assert max_diff(
      checkpoints.load_model(config, str(workdir / path)).trainable_variables,
      checkpoints.load_model(config, str(whole / path)).trainable_variables,
  ) == 0.0
