"""--async_checkpoint: training goes on while a checkpoint is written, the
index names a checkpoint only once it is complete, and a crash mid-write
costs what a crash between saves costs; the goodput record shows it."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint as tf_checkpoint  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import config as tf_config  # pylint: disable=g-direct-tensorflow-import

from conftest import REPO, checkpoint_variables, max_diff, run_main
from controller_fakes import FakeCheckpointer, FakeTrainer
from dist_loop import make_config
from dist_loop import train
from dist_loop.control import actions, weights
from dist_loop.core.errors import Interrupted, NonFiniteError, UserError
from dist_loop.parallel.modes.sync import SyncTrainer
from dist_loop.runtime import checkpoints, goodput, preemption

STEPS = 30
RUN = dict(dataset="synthetic", model="mlp", global_batch_size=32,
           optimizer="adam", learning_rate=0.01, steps_per_loop=5,
           log_every=5, checkpoint_every=10, eval_every=1000, seed=0,
           num_devices=2, max_checkpoints=100)

# Runs the entry point with the background write of checkpoint 20 held
# after its files are written, before the index names it: the moment a
# crash is most tempting to get wrong.
_HELD_SAVE = textwrap.dedent("""
    import os, runpy, sys, threading, time
    from tensorflow.python.checkpoint import checkpoint
    save, marker = checkpoint.TrackableSaver.save, sys.argv[1]
    def held(self, file_prefix, *args, **kwargs):
      out = save(self, file_prefix, *args, **kwargs)
      if (threading.current_thread() is not threading.main_thread()
          and str(file_prefix).endswith("ckpt-20")):
        open(marker, "w").close()
        time.sleep(300)
      return out
    checkpoint.TrackableSaver.save = held
    sys.argv = ["train", *sys.argv[2:]]
    runpy.run_module("experiments.train", run_name="__main__")
""")


def _args(workdir, *extra):
  return [*[f"--{k}={v}" for k, v in RUN.items()], f"--train_steps={STEPS}",
          "--deterministic", f"--workdir={workdir}", *extra]


def _indexed(workdir):
  return tf.train.latest_checkpoint(str(workdir / "checkpoints"))


def test_sigkill_inside_an_async_save_then_resume_equals_uninterrupted(
    tmp_path):
  """A process SIGKILLed while checkpoint 20's files are written but not
  yet indexed: the index still names 10, the rerun resumes from 10, its
  record counts the steps after 10 the first attempt reached as
  recomputed, and it ends with the variables of a run never interrupted
  (with synchronous saves: the two kinds of save hold the same state)."""
  workdir, whole, inside = tmp_path / "run", tmp_path / "whole", tmp_path / "in"
  proc = subprocess.Popen(
      [sys.executable, "-c", _HELD_SAVE, str(inside),
       *_args(workdir, "--async_checkpoint")],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
  try:
    try:  # Meanwhile, the reference; op determinism is process-wide.
      train.run(make_config(workdir=str(whole), train_steps=STEPS,
                            deterministic=True, **RUN))
    finally:
      tf_config.disable_op_determinism()
    deadline = time.time() + 300
    while not inside.exists():
      assert proc.poll() is None, proc.communicate()[1][-2000:]
      assert time.time() < deadline, "the save was never held"
      time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.kill()
    proc.communicate(timeout=30)
  assert _indexed(workdir).endswith("ckpt-10")
  assert os.path.exists(workdir / "checkpoints" / "ckpt-20.index")
  [killed] = goodput.read(str(workdir / goodput.GOODPUT_FILE))
  assert killed["furthest"] >= 20 and not killed["final"]
  try:
    code, _, err = run_main(*_args(workdir, "--async_checkpoint"))
  finally:
    tf_config.disable_op_determinism()
  assert code == 0, err[-2000:]
  # The run waited for its last save: the index names it.
  assert _indexed(workdir).endswith(f"ckpt-{STEPS}")
  config = make_config(workdir=str(workdir), **RUN)
  for step in (20, STEPS):
    path = f"checkpoints/ckpt-{step}"
    assert max_diff(
        weights.load_model(config, str(workdir / path)).trainable_variables,
        weights.load_model(config, str(whole / path)).trainable_variables,
    ) == 0.0
  attempts = goodput.read(str(workdir / goodput.GOODPUT_FILE))
  assert [a["restored"] for a in attempts] == [0, 10]
  lost = killed["furthest"] - 10
  assert attempts[1]["steps"]["recomputed"] == lost
  with open(workdir / "summary.json", encoding="utf-8") as f:
    summary = json.load(f)
  assert summary["goodput_recomputed_steps"] == lost
  assert summary["goodput_recomputed_s"] > 0
  assert summary["goodput_downtime_s"] > 0
  assert summary["goodput_attempts"] == 2


def _tensors(path):
  """Every tensor of a checkpoint but TensorFlow's own save counter."""
  reader = tf.train.load_checkpoint(path)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if not k.startswith(("save_counter", "_CHECKPOINTABLE"))}


@pytest.mark.parametrize("flat", [
    dict(mode="pipeline", num_devices=2, num_stages=2, num_microbatches=4),
    dict(mode="sync", num_devices=2, precision="mixed_float16"),
], ids=["pipeline", "sync_float16"])
def test_a_background_save_holds_what_a_synchronous_one_holds(
    small_config, tmp_path, flat):
  """Each checkpoint of an --async_checkpoint run, tensor by tensor, equals
  the synchronous run's of the same step (a loss scale included)."""
  paths = {}
  for name, more in (("sync", {}), ("async", dict(async_checkpoint=True))):
    config = small_config(workdir=str(tmp_path / name), checkpoint_every=5,
                          max_checkpoints=10, deterministic=True, **flat,
                          **more)
    try:
      train.run(config)
    finally:
      tf_config.disable_op_determinism()
    paths[name] = os.path.join(config.workdir, "checkpoints")
  for step in (5, 10):
    saved = {n: _tensors(os.path.join(p, f"ckpt-{step}"))
             for n, p in paths.items()}
    assert sorted(saved["sync"]) == sorted(saved["async"])
    for key, value in saved["sync"].items():
      np.testing.assert_array_equal(value, saved["async"][key], err_msg=key)


def _slow_background_writes(monkeypatch, seconds):
  """Background writes take `seconds` longer, before the index names them."""
  save = tf_checkpoint.TrackableSaver.save

  def slow(self, *args, **kwargs):
    if threading.current_thread() is not threading.main_thread():
      time.sleep(seconds)
    return save(self, *args, **kwargs)

  monkeypatch.setattr(tf_checkpoint.TrackableSaver, "save", slow)


def test_restore_and_the_next_save_wait_for_the_save_in_flight(
    tmp_path, monkeypatch):
  """A rollback right after a background save restores that save; the next
  save starts only once it is indexed (one in flight)."""
  _slow_background_writes(monkeypatch, 0.5)
  value = tf.Variable(1.0)
  checkpointer = checkpoints.Checkpointer({"step": value}, str(tmp_path), 3,
                                          async_save=True)
  checkpointer.save(1)
  value.assign(2.0)  # After the save's copy: not in checkpoint 1.
  assert checkpointer.saved_step == 1
  assert checkpointer.restore(tf.init_scope()).endswith("ckpt-1")
  assert float(value) == 1.0
  value.assign(3.0)
  checkpointer.save(2)
  index = os.path.join(tmp_path, "checkpoints")
  checkpointer.save(3)  # Waited for 2 before starting.
  assert checkpointer.manager.checkpoints[-1].endswith("ckpt-2")
  checkpointer.wait()
  assert tf.train.latest_checkpoint(index).endswith("ckpt-3")


def test_a_rollback_right_after_a_background_save_restores_it(
    small_config, tmp_path, monkeypatch):
  """The 4th inner loop (steps 4-6) fails once after its updates, while
  checkpoint 4 is still being written (each write takes half a second
  longer): the rollback waits for it, restores it, and the run ends where
  an uninterrupted one with synchronous saves does."""
  run = dict(train_steps=12, checkpoint_every=4, steps_per_loop=2,
             log_every=2, optimizer="adam", learning_rate=0.01,
             nonfinite="rollback", num_devices=2)
  clean = small_config(workdir=str(tmp_path / "clean"), **run)
  train.run(clean)
  _slow_background_writes(monkeypatch, 0.5)
  original, calls = SyncTrainer.train, []

  def flaky(self, n):
    calls.append(n)
    if len(calls) == 4:
      original(self, n)
      raise NonFiniteError(int(self.step.numpy()))
    return original(self, n)

  monkeypatch.setattr(SyncTrainer, "train", flaky)
  faulty = small_config(workdir=str(tmp_path / "faulty"),
                        async_checkpoint=True, **run)
  summary = train.run(faulty)
  assert summary["rollbacks"] == 1 and summary["final_step"] == 12
  assert max_diff(checkpoint_variables(clean),
                  checkpoint_variables(faulty)) <= 1e-6
  [attempt] = goodput.read(os.path.join(faulty.workdir, goodput.GOODPUT_FILE))
  assert attempt["steps"]["recomputed"] == 2  # Steps 5 and 6, again.


def test_a_failed_background_write_is_one_line_and_leaves_the_previous(
    tmp_path, monkeypatch):
  """A background write that fails (a full disk) surfaces at the next wait:
  its files are removed and the message names the intact checkpoint."""
  checkpointer = checkpoints.Checkpointer({"step": tf.Variable(1.0)},
                                          str(tmp_path), 3, async_save=True)
  checkpointer.save(1)
  checkpointer.wait()
  save = tf_checkpoint.TrackableSaver.save

  def full(self, file_prefix, *args, **kwargs):
    save(self, file_prefix, *args, **kwargs)  # Files, then the disk fills.
    raise tf.errors.ResourceExhaustedError(None, None, "No space left")

  monkeypatch.setattr(tf_checkpoint.TrackableSaver, "save", full)
  checkpointer.save(2)
  with pytest.raises(UserError, match="checkpoint of step 2.*No space left"
                     ".*ckpt-1, is intact"):
    checkpointer.wait()
  index = os.path.join(tmp_path, "checkpoints")
  assert tf.train.latest_checkpoint(index).endswith("ckpt-1")
  assert sorted(os.listdir(index)) == ["checkpoint", "ckpt-1.data-00000-of-"
                                       "00001", "ckpt-1.index"]


def test_a_preempted_run_exits_with_its_last_save_indexed(
    small_config, monkeypatch):
  """SIGTERM's stop (asked after the fourth loop: 0-1, 1-5, 5-10, 10-15)
  saves in the
  background and waits: when the run has stopped, the index names step 15,
  though each background write takes a second longer. Both waits, for the
  save of step 10 and for that of 15, are on the record as checkpoint time
  (the stop's own wait, not only the one as the run closes)."""
  _slow_background_writes(monkeypatch, 1.0)
  asked = []
  monkeypatch.setattr(preemption.Sigterm, "requested",
                      lambda self: asked.append(1) or len(asked) == 4)
  config = small_config(train_steps=40, checkpoint_every=10,
                        async_checkpoint=True)
  with pytest.raises(Interrupted) as stopped:
    train.run(config)
  assert stopped.value.saved and stopped.value.step == 15
  index = os.path.join(config.workdir, "checkpoints")
  assert tf.train.latest_checkpoint(index).endswith("ckpt-15")
  [attempt] = goodput.read(os.path.join(config.workdir, goodput.GOODPUT_FILE))
  assert not attempt["final"] and attempt["step"] == 15
  assert attempt["phases"]["checkpoint"] >= 2.0


def test_the_checkpoint_action_waits_at_the_end_and_when_stopped():
  trainer = FakeTrainer([])
  checkpointer = FakeCheckpointer(trainer, [])
  checkpoint = actions.Checkpoint(10, checkpointer, 30)
  trainer.value = 20
  checkpoint(20)
  assert checkpointer.waited == []  # Training goes on meanwhile.
  trainer.value = 23
  checkpoint.interrupted(23)
  trainer.value = 30
  checkpoint(30)
  assert checkpointer.waited == [23, 30]


@pytest.mark.parametrize("flags,why", [
    (["--mode=ps"], "--mode=ps keeps its variables on the parameter servers"),
    (["--mode=local_sgd"], "--mode=local_sgd checkpoints each replica's"),
    (["--reducer=zero1"], "--reducer=zero1 checkpoints optimizer slots"),
    (["--shard=optimizer"], "--reducer=zero1 checkpoints optimizer slots"),
    (["--reducer=topk"], "--reducer=topk checkpoints each replica's own"),
])
def test_state_the_background_save_cannot_copy_is_refused_in_one_line(
    tmp_path, flags, why):
  code, _, err = run_main(*flags, f"--workdir={tmp_path / 'run'}",
                          "--async_checkpoint")
  assert code != 0
  [line] = [l for l in err.splitlines() if "async_checkpoint" in l]
  assert f"--async_checkpoint cannot be used here: {why}" in line, err
  assert "Traceback" not in err and not (tmp_path / "run").exists()
