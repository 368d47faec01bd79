"""Multi-worker sync: MultiWorkerMirroredStrategy across local processes.

Two worker processes (one replica each) must train exactly like one process
with two devices: same data per step, same all-reduce, same update. A dead
peer must fail the other, not hang it, and restarting both workers (what
the error tells the user to do) must resume as if nothing happened. One
story, told once: it is the slowest test of the suite.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO, run_launch
from dist_loop import checkpoints, make_config
from dist_loop.summaries import LOGDIR, TRAIN
from helpers import make_trainer, variables
from tools import launch

# Short enough to wait out after the kill; the restart only needs a bound
# that never fires on a slow machine.
KILL_TIMEOUT_S = 15
RESTART_TIMEOUT_S = 60
RUN = dict(dataset="synthetic", model="mlp", global_batch_size=32,
           optimizer="adam", learning_rate=0.01, steps_per_loop=5,
           log_every=10, eval_every=100000, checkpoint_every=10, seed=0)


def _flags(**overrides):
  return [f"--{k}={v}" for k, v in {**RUN, **overrides}.items()]


def _start_workers(workdir, log_dir):
  """Two workers, started without the launcher (which would stop the
  survivor itself), training until they are stopped."""
  spec = launch.cluster_spec(num_workers=2, num_ps=0)
  procs, logs = [], []
  for i in range(2):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_CONFIG": json.dumps({"cluster": spec,
                                    "task": {"type": "worker", "index": i}})}
    logs.append(log_dir / f"worker-{i}.log")
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "experiments.train",
         *_flags(train_steps=100000, num_devices=1,
                 collective_timeout_s=KILL_TIMEOUT_S),
         f"--workdir={workdir}"], cwd=REPO, env=env,
        stdout=open(logs[i], "w"), stderr=subprocess.STDOUT))
  return procs, logs


@pytest.fixture(name="story", scope="module")
def _story(tmp_path_factory):
  """Kill worker 1 after step 20; then restart both to 10 steps past the
  last checkpoint."""
  root = tmp_path_factory.mktemp("mw")
  workdir = root / "run"
  procs, logs = _start_workers(workdir, root)
  try:
    deadline = time.monotonic() + 120
    while "step 20/" not in logs[0].read_text():
      assert time.monotonic() < deadline and procs[0].poll() is None, (
          logs[0].read_text()[-3000:])
      time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    # The survivor must give up by itself, within the collective timeout
    # plus slack (the bound here only guards against a hang).
    code = procs[0].wait(timeout=KILL_TIMEOUT_S + 60)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  killed_log = logs[0].read_text()
  saved = tf.train.latest_checkpoint(
      str(workdir / checkpoints.CHECKPOINT_DIR))
  last = int(saved.rsplit("-", 1)[-1])
  # With thread flags: the strategy starts the runtime, so they must be
  # set before it is built.
  restart = run_launch(
      "--num_workers=2", "--", sys.executable, "-m", "experiments.train",
      *_flags(train_steps=last + 10, num_devices=1,
              collective_timeout_s=RESTART_TIMEOUT_S, intra_op_threads=1,
              inter_op_threads=2),
      f"--workdir={workdir}", timeout=150)
  return dict(workdir=str(workdir), code=code, killed_log=killed_log,
              last=last, restart=restart)


def test_a_killed_worker_fails_the_other_with_a_clear_error(story):
  out = story["killed_log"]
  assert story["code"] == 1, out[-3000:]
  assert "error: a peer worker failed or is unreachable" in out, out[-3000:]
  assert "Traceback" not in out


def test_two_workers_equal_one_process_with_two_devices(story):
  """At the last checkpoint before the kill, and 10 steps after both
  workers resumed from it."""
  assert story["restart"].returncode == 0, story["restart"].stdout[-4000:]
  last = story["last"]
  assert last >= 20
  config = make_config(workdir=story["workdir"], num_devices=1,
                       train_steps=last + 10, **RUN)
  local = make_trainer(config.replace(num_devices=2))
  for step, steps in ((last, last), (last + 10, 10)):
    local.train(steps)
    path = os.path.join(story["workdir"], checkpoints.CHECKPOINT_DIR,
                        f"ckpt-{step}")
    cluster = checkpoints.load_model(config, path).trainable_variables
    for a, b in zip(variables(local), cluster):
      np.testing.assert_allclose(a, np.asarray(b), atol=1e-5, rtol=0)
  local.close()


def test_thread_flags_work_with_multi_worker_runs(story):
  """The restart ran with --intra_op_threads and --inter_op_threads."""
  out = story["restart"].stdout
  assert story["restart"].returncode == 0, out[-4000:]
  assert "thread counts must be set" not in out
  assert f"[worker:1] done: step {story['last'] + 10}" in out


def test_both_workers_resumed_and_only_the_chief_wrote(story):
  workdir, last = story["workdir"], story["last"]
  for i in range(2):
    with open(os.path.join(workdir, "logs", f"worker-{i}.log")) as f:
      log = f.read()
    assert "Resumed from" in log and f"ckpt-{last}" in log, log[-3000:]
  assert f"[worker:1] done: step {last + 10}" in story["restart"].stdout
  ckpt_dir = os.path.join(workdir, checkpoints.CHECKPOINT_DIR)
  assert not [n for n in os.listdir(ckpt_dir) if n.startswith("workertemp")]
  # One train event file per run (the killed one and the restart): the
  # chief's; the other worker's writers are no-ops.
  assert len(glob.glob(os.path.join(workdir, LOGDIR, TRAIN,
                                    "events.out.tfevents.*"))) == 2
