"""Parameter-server mode: a chief, two workers and a parameter server.

Trains `digits` to a sensible accuracy with the staleness bound respected
and every update counted; a worker killed mid-run is ridden out; a killed
parameter server stops the run with a clear error, and rerunning resumes.
"""

import json
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf

from conftest import run_launch
from dist_loop import Config, checkpoints
from dist_loop.evaluation import Evaluator
from dist_loop.data import DATASETS

from tools import launch

MAX_STALENESS = 0  # The tightest bound: every applied gradient is fresh.


def _command(workdir, **overrides):
  flags = dict(mode="ps", num_devices=1, global_batch_size=32,
               optimizer="adam", learning_rate=0.003, ps_steps_per_call=4,
               steps_per_loop=40, log_every=40, eval_every=1000,
               checkpoint_every=1000, collective_timeout_s=30, seed=0)
  flags.update(overrides)
  return [sys.executable, "-m", "experiments.train",
          *[f"--{k}={v}" for k, v in flags.items()], f"--workdir={workdir}"]


def _summary(workdir):
  with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
    return json.load(f)


def test_ps_trains_digits_within_the_staleness_bound(tmp_path):
  workdir = tmp_path / "run"
  steps = 400
  result = run_launch("--num_workers=2", "--num_ps=1", "--",
                      *_command(workdir, dataset="digits", model="mlp",
                                train_steps=steps,
                                max_staleness=MAX_STALENESS), timeout=150)
  assert result.returncode == 0, result.stdout[-4000:]
  s = _summary(workdir)
  print({k: v for k, v in s.items() if k.startswith(("ps_", "eval"))})
  assert s["final_step"] == steps
  assert s["eval_accuracy"] > 0.9
  # Every applied update was counted exactly once, by the atomic counter,
  # and had a staleness within the bound when it was applied.
  assert s["ps_applied"] == steps
  counts = {int(t): c for t, c in s["ps_staleness_counts"].items()}
  assert sum(counts.values()) == steps
  assert max(counts) <= MAX_STALENESS
  assert s["ps_staleness_max"] <= MAX_STALENESS
  assert s["ps_dropped"] >= 0 and s["ps_workers"] == 2
  # Decide-and-apply is serialised by the PS lock: the optimizer's own
  # read-modify-write counter, which loses increments under concurrent
  # updates, lost none.
  assert s["ps_optimizer_iterations"] == steps
  # The checkpoint has the names of every other mode: a plain model reads it.
  config = Config(workdir=str(workdir), dataset="digits", model="mlp")
  model = checkpoints.load_model(config)
  split = DATASETS.get("digits")(None, 0, None)
  accuracy = Evaluator(model, split, 256).evaluate()["eval/accuracy"]
  np.testing.assert_allclose(accuracy, s["eval_accuracy"], atol=1e-6)


def _wait_for(path, text, launcher, timeout=90):
  deadline = time.monotonic() + timeout
  while not (os.path.exists(path) and text in open(path).read()):
    assert time.monotonic() < deadline, f"no {text!r} in {path}"
    assert all(t.poll() is None for t in launcher.tasks.values())
    time.sleep(0.2)


def test_a_killed_worker_is_ridden_out(tmp_path):
  # Two parameter servers: the variables are spread over both, and the
  # update lock on ps:0 still orders every update (one count, no loss).
  workdir = tmp_path / "run"
  steps = 400
  launcher = launch.Launcher(
      _command(workdir, dataset="synthetic", model="mlp", train_steps=steps,
               steps_per_loop=20, log_every=20), num_workers=2, num_ps=2,
      log_dir=str(workdir / "logs"), timeout_s=120, quiet=True)
  launcher.start()
  try:
    _wait_for(workdir / "logs" / "chief-0.log", "step 40/", launcher)
    launcher.tasks["worker:1"].signal(signal.SIGKILL)
    code = launcher.wait()
  finally:
    launcher.stop()
  assert code == 0, open(workdir / "logs" / "chief-0.log").read()[-4000:]
  assert launcher.tasks["worker:1"].poll() == -signal.SIGKILL
  s = _summary(workdir)
  assert s["final_step"] == steps and s["ps_applied"] == steps
  assert s["ps_optimizer_iterations"] == steps
  assert s["ps_servers_holding_weights"] == 2


def test_a_killed_ps_stops_the_run_and_a_rerun_resumes(tmp_path):
  workdir = tmp_path / "run"
  command = _command(workdir, dataset="synthetic", model="mlp",
                     train_steps=100000, steps_per_loop=20, log_every=20,
                     checkpoint_every=40)
  launcher = launch.Launcher(command, num_workers=2, num_ps=1,
                             log_dir=str(workdir / "logs"), timeout_s=120,
                             quiet=True)
  launcher.start()
  try:
    _wait_for(workdir / "logs" / "chief-0.log", "saved checkpoint", launcher)
    launcher.tasks["ps:0"].signal(signal.SIGKILL)
    # Not `launcher.wait()`: the launcher would stop the chief as soon as
    # the PS died; here the chief must notice by itself, and say so.
    code = launcher.tasks["chief:0"].process.wait(timeout=90)
  finally:
    launcher.stop()
  chief_log = open(workdir / "logs" / "chief-0.log").read()
  assert code == 1, chief_log[-4000:]
  assert "error: a parameter server is unreachable" in chief_log
  assert "Traceback" not in chief_log
  saved = tf.train.latest_checkpoint(str(workdir / "checkpoints"))
  saved_step = int(saved.rsplit("-", 1)[1])
  # A new cluster, the same command (fewer steps, so it ends): it resumes.
  final = saved_step + 20
  result = run_launch("--num_workers=2", "--num_ps=1", "--",
                      *_command(workdir, dataset="synthetic", model="mlp",
                                train_steps=final, steps_per_loop=20,
                                log_every=20, checkpoint_every=40),
                      timeout=150)
  assert result.returncode == 0, result.stdout[-4000:]
  assert f"Resumed from {saved}" in result.stdout
  assert _summary(workdir)["final_step"] == final
