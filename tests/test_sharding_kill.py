"""A sharded run killed with SIGKILL resumes as if nothing happened.

The process dies between checkpoints, with shards on every device and
nothing flushed; rerunning the command restores the newest checkpoint (full
tensors, `sharding/state.py`), cuts the shards again and goes on.
"""

import os
import signal
import subprocess
import sys
import time

import tensorflow as tf

from conftest import REPO, checkpoint_variables, max_diff, trained_variables
from dist_loop import make_config

RUN = dict(dataset="synthetic", model="mlp", global_batch_size=32,
           optimizer="adam", learning_rate=0.01, steps_per_loop=3,
           log_every=3, eval_every=100000, checkpoint_every=3, seed=0,
           num_devices=2, shard="gradients")


def _command(workdir, steps):
  return [sys.executable, "-m", "experiments.train", f"--workdir={workdir}",
          f"--train_steps={steps}",
          *[f"--{k}={v}" for k, v in RUN.items()]]


def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
  workdir = tmp_path / "killed"
  ckpts = workdir / "checkpoints"
  process = subprocess.Popen(
      _command(workdir, 10**6), cwd=REPO, stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL, env={**os.environ,
                                      "TF_CPP_MIN_LOG_LEVEL": "2"})
  try:
    deadline = time.monotonic() + 180
    while tf.train.latest_checkpoint(str(ckpts)) is None:
      assert process.poll() is None and time.monotonic() < deadline
      time.sleep(0.2)
  finally:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
  saved = int(tf.train.latest_checkpoint(str(ckpts)).rsplit("-", 1)[1])
  target = saved + 3
  result = subprocess.run(_command(workdir, target), cwd=REPO,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
  assert result.returncode == 0, result.stderr[-2000:]
  resumed = checkpoint_variables(make_config(workdir=str(workdir), **RUN))
  uninterrupted = trained_variables(make_config(
      workdir=str(tmp_path / "whole"), train_steps=target, **RUN))
  assert max_diff(resumed, uninterrupted) <= 1e-6
