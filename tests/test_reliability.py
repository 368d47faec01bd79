"""Faults: non-finite values, corrupt checkpoints, config drift, signals.

The rule under test: a run never loses more than a checkpoint interval,
never reads a half-written file, never hangs, and resumes to the same
variables as a run that was never interrupted.
"""

import glob
import logging
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
from dist_loop import make_config, train
from dist_loop.control import weights
from dist_loop.core.errors import NonFiniteError, UserError
from dist_loop.data import stream
from dist_loop.data.base import DATASETS, Dataset
from dist_loop.parallel.modes import sync
from dist_loop.parallel.modes.asynchronous.trainer import AsyncTrainer
from dist_loop.parallel.modes.pipeline import PipelineTrainer
from dist_loop.runtime import checkpoints, preemption

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
# sequential SGD, so that the two runs can be compared exactly. The pipeline
# runs --deterministic, and plans from eagerly timed layers (`eager_costs`),
# quicker to start than timing traced chunks (not what is tested here).
ROLLBACK_MODES = {
    "sync": (sync.SyncTrainer, dict(num_devices=2)),
    "pipeline": (PipelineTrainer, dict(mode="pipeline", num_devices=2,
                                       num_stages=2, num_microbatches=2,
                                       deterministic=True)),
    "async": (AsyncTrainer, dict(mode="async", num_devices=1,
                                 async_workers=1)),
}
ROLLBACK_RUN = dict(train_steps=12, checkpoint_every=4, steps_per_loop=2,
                    log_every=2, optimizer="adam", learning_rate=0.01,
                    nonfinite="rollback")


def _rollback(mode, small_config, tmp_path, monkeypatch):
  """An uninterrupted run and one whose 4th inner loop fails once after
  its updates: the second rolls back once and must end where the first
  did. Returns both configs."""
  trainer_class, extra = ROLLBACK_MODES[mode]
  clean = small_config(workdir=str(tmp_path / "clean"), **ROLLBACK_RUN,
                       **extra)
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
  faulty = small_config(workdir=str(tmp_path / "faulty"), **ROLLBACK_RUN,
                        **extra)
  summary = train.run(faulty)
  assert summary["rollbacks"] == 1 and summary["final_step"] == 12
  assert max_diff(checkpoint_variables(clean),
                  checkpoint_variables(faulty)) <= 1e-6
  return clean, faulty


# Sync is the third mode: test_sync_rolls_back_falls_back_and_keeps_its_layout.
@pytest.mark.parametrize("mode", ["async", "pipeline"])
@pytest.mark.usefixtures("eager_costs")
def test_transient_nonfinite_rollback_equals_uninterrupted(
    small_config, tmp_path, monkeypatch, mode):
  _rollback(mode, small_config, tmp_path, monkeypatch)


def test_sync_rolls_back_falls_back_and_keeps_its_layout(
    small_config, tmp_path, monkeypatch):
  """One sync run (two devices) for three stories: a transient non-finite
  loop rolled back equals the uninterrupted run; its corrupt latest
  checkpoint is skipped for the one before, and the rerun ends as the
  uninterrupted run (a schedule flag changed on the way, which needs no
  permission); a change of layout is refused, untouched, unless allowed."""
  clean, faulty = _rollback("sync", small_config, tmp_path, monkeypatch)
  ckpt_dir = os.path.join(faulty.workdir, "checkpoints")
  data_file = glob.glob(os.path.join(ckpt_dir, "ckpt-12.data-*"))[0]
  with open(data_file, "r+b") as f:
    f.truncate(os.path.getsize(data_file) // 2)
  restored = []  # (path, the step counter right after the restore)
  real_restore = checkpoints.Checkpointer.restore

  def spy(self, scope):
    path = real_restore(self, scope)
    restored.append((path, int(self.items["step"].numpy())))
    return path

  monkeypatch.setattr(checkpoints.Checkpointer, "restore", spy)
  summary = train.run(faulty.replace(log_every=4))
  # It resumed from ckpt-8 (a restart from step 0 would end the same).
  assert restored == [(os.path.join(ckpt_dir, "ckpt-8"), 8)]
  assert summary["final_step"] == 12
  assert max_diff(checkpoint_variables(clean),
                  checkpoint_variables(faulty)) <= 1e-6
  with open(os.path.join(faulty.workdir, "flags.txt")) as f:
    before = f.read()
  with pytest.raises(UserError, match="--num_devices: 2 -> 1"):
    train.run(faulty.replace(num_devices=1, train_steps=14))
  with open(os.path.join(faulty.workdir, "flags.txt")) as f:
    assert f.read() == before  # Refused before touching anything.
  summary = train.run(faulty.replace(num_devices=1, train_steps=14,
                                     allow_config_change=True))
  assert summary["final_step"] == 14


def test_a_runtime_error_anywhere_in_the_run_is_explained_by_the_mode(
    small_config, monkeypatch):
  # Not only in `train`: a peer can be lost in a checkpoint, an evaluation
  # or the controller's read of the step. Here, the evaluation.
  from dist_loop.control import evaluation  # pylint: disable=g-import-not-at-top

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


# The signals' chain: sharded state (ZeRO-2) on two devices, --deterministic.
SIGNAL_STEPS = 30
SIGNAL_RUN = dict(dataset="synthetic", model="mlp", global_batch_size=32,
                  optimizer="adam", learning_rate=0.01, steps_per_loop=5,
                  log_every=5, checkpoint_every=5, eval_every=1000, seed=0,
                  num_devices=2, shard="gradients", max_checkpoints=100)


def _args(workdir, *extra):
  return [*[f"--{k}={v}" for k, v in SIGNAL_RUN.items()],
          f"--train_steps={SIGNAL_STEPS}", "--deterministic",
          f"--workdir={workdir}", *extra]


def _start(workdir, *extra):
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.train", *_args(workdir, *extra)],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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


class _SigtermAtCheckpoint(threading.Thread):
  """SIGTERM to this process once the run in its main thread saved a
  checkpoint other than `after`; gives up when told the run ended."""

  def __init__(self, workdir, after, timeout=300):
    super().__init__(daemon=True)
    self.workdir, self.after, self.timeout = workdir, after, timeout
    self.ended, self.sent = threading.Event(), False
    self.start()

  def run(self):
    deadline = time.time() + self.timeout
    while not self.ended.is_set() and time.time() < deadline:
      if _latest(self.workdir) not in (None, self.after):
        os.kill(os.getpid(), signal.SIGTERM)
        self.sent = True
        return
      time.sleep(0.05)

  def wait(self):
    self.ended.set()
    self.join(timeout=30)
    assert not self.is_alive(), "the watcher did not end"


def _cancel_watchdogs():
  """Cancels every grace-period watchdog (a `preemption.Sigterm`'s timer)
  left running in this process; returns how many."""
  watchdogs = [t for t in threading.enumerate()
               if isinstance(t, threading.Timer) and isinstance(
                   getattr(t.function, "__self__", None), preemption.Sigterm)]
  for watchdog in watchdogs:
    watchdog.cancel()
  return len(watchdogs)


def test_sigkill_then_sigterm_then_resume_equals_uninterrupted(tmp_path,
                                                               caplog):
  """One workdir: a process SIGKILLed between checkpoints with shards on
  every device and nothing flushed (no handler, no cleanup, maybe
  mid-write); rerun (in this process, through the entry point), it resumes
  (full tensors, cut again: sharding/state.py) and gets SIGTERM, so it saves
  and stops with the variables of a run never interrupted (trained here,
  with the same op determinism, while the first process starts); rerun
  again, it finishes. That a preempted process exits with 143 is
  test_multiworker.py's (its launcher ends with its worker's code)."""
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
  # A SIGTERM that came too late for the run is recorded here instead of
  # ending the test process. The grace period's watchdog is generous, so
  # only a hang would reach it; it outlives the run (it bounds a process's
  # teardown), and is cancelled here before it could end this process.
  late = []
  previous = signal.signal(signal.SIGTERM, lambda *_: late.append(True))
  try:
    terminator = _SigtermAtCheckpoint(workdir, killed_at)
    try:
      # --verbosity=0 as a new process has it: the log's INFO lines kept.
      with caplog.at_level(logging.INFO, logger="absl"):
        code, out, err = run_main(*_args(workdir, "--straggler=0:20",
                                         "--grace_period_s=60",
                                         "--verbosity=0"))
    finally:
      terminator.wait()
      watchdogs = _cancel_watchdogs()
      tf_config.disable_op_determinism()
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert terminator.sent and not late, (code, err[-2000:])
  assert watchdogs == 1  # The SIGTERM's, cancelled before it could fire.
  assert code == 143, err[-2000:]
  assert "Traceback" not in err
  assert f"Resumed from {killed_at}." in caplog.text, caplog.text[-2000:]
  assert "SIGTERM at step " in err, err[-2000:]
  step = int(err.split("SIGTERM at step ")[1].split(";")[0])
  start = int(killed_at.rsplit("-", 1)[1])
  assert start < step < SIGNAL_STEPS and step % 5 == 0
  assert _latest(workdir).endswith(f"ckpt-{step}")
  # Rerunning resumes from there (without op determinism, which is
  # process-wide).
  code, out, err = run_main(f"--flagfile={workdir / 'flags.txt'}",
                            "--nodeterministic", "--straggler=")
  assert code == 0, err
  assert f"done: step {SIGNAL_STEPS}" in out
  assert _latest(workdir).endswith(f"ckpt-{SIGNAL_STEPS}")
  config = make_config(workdir=str(workdir), **SIGNAL_RUN)
  path = f"checkpoints/ckpt-{step}"
  assert max_diff(
      weights.load_model(config, str(workdir / path)).trainable_variables,
      weights.load_model(config, str(whole / path)).trainable_variables,
  ) == 0.0
