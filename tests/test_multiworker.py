"""Multi-worker sync: MultiWorkerMirroredStrategy across local processes.

Two worker processes (one replica each, through tools/launch.py) must train
exactly like one process with two devices: same data per step, same
all-reduce, same update. A dead peer must fail the others, not hang them.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, run_launch
from dist_loop import checkpoints, train

from tools import launch

# The equality runs only need a bound that never fires on a slow machine;
# the kill test needs one short enough to wait out.
COLLECTIVE_TIMEOUT_S = 60
KILL_TIMEOUT_S = 15
RUN = dict(dataset="synthetic", model="mlp", global_batch_size=32,
           optimizer="adam", learning_rate=0.01, steps_per_loop=5,
           log_every=5, eval_every=10, checkpoint_every=10, seed=0)


def _flags(**overrides):
  values = {**RUN, **overrides}
  return [f"--{k}={v}" for k, v in values.items()]


def _train_cluster(workdir, steps):
  return run_launch(
      "--num_workers=2", "--", sys.executable, "-m", "experiments.train",
      *_flags(train_steps=steps, num_devices=1,
              collective_timeout_s=COLLECTIVE_TIMEOUT_S),
      f"--workdir={workdir}", timeout=150)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A 2-worker run to step 20, resumed to 30; and a 1-process 2-device run."""
  root = tmp_path_factory.mktemp("mw")
  cluster_dir = str(root / "cluster")
  first = _train_cluster(cluster_dir, 20)
  assert first.returncode == 0, first.stdout[-4000:]
  resumed = _train_cluster(cluster_dir, 30)
  assert resumed.returncode == 0, resumed.stdout[-4000:]
  from dist_loop import Config  # pylint: disable=g-import-not-at-top
  local = Config(workdir=str(root / "local"), num_devices=2, train_steps=30,
                 **RUN)
  train.run(local)
  return local, local.replace(workdir=cluster_dir, num_devices=1), resumed


def _variables(config, step):
  path = os.path.join(config.workdir, checkpoints.CHECKPOINT_DIR,
                      f"ckpt-{step}")
  return [v.numpy() for v in checkpoints.load_model(config, path).weights]


@pytest.mark.parametrize("step", [20, 30])
def test_two_workers_equal_one_process_with_two_devices(runs, step):
  """Step 20: the first run; step 30: after both workers resumed from 20."""
  local, cluster, _ = runs
  pairs = list(zip(_variables(local, step), _variables(cluster, step)))
  print(f"step {step}: max |local - cluster| = "
        f"{max(np.abs(a - b).max() for a, b in pairs):.3g}")
  for a, b in pairs:
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  summary = json.load(open(os.path.join(cluster.workdir, "summary.json")))
  assert summary["final_step"] == 30


def test_only_the_chief_writes_and_worker_checkpoints_are_cleaned_up(runs):
  _, cluster, resumed = runs
  ckpt_dir = os.path.join(cluster.workdir, checkpoints.CHECKPOINT_DIR)
  assert not [n for n in os.listdir(ckpt_dir) if n.startswith("workertemp")]
  assert len(os.listdir(os.path.join(cluster.workdir, "tb"))) == 2  # 2 runs
  for i in range(2):
    log = open(os.path.join(cluster.workdir, "logs",
                            f"worker-{i}.log")).read()
    assert "Resumed from" in log and "ckpt-20" in log
  assert "[worker:1] done: step 30" in resumed.stdout


def test_a_killed_worker_fails_the_others_with_a_clear_error(tmp_path):
  """Started without the launcher (which would stop the survivor itself)."""
  spec = launch.cluster_spec(num_workers=2, num_ps=0)
  workdir = tmp_path / "run"
  procs, logs = [], []
  for i in range(2):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_CONFIG": json.dumps({"cluster": spec,
                                    "task": {"type": "worker", "index": i}})}
    logs.append(tmp_path / f"worker-{i}.log")
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "experiments.train",
         *_flags(train_steps=100000, num_devices=1, log_every=10,
                 eval_every=100000, checkpoint_every=100000,
                 collective_timeout_s=KILL_TIMEOUT_S),
         f"--workdir={workdir}"], cwd=REPO, env=env,
        stdout=open(logs[i], "w"), stderr=subprocess.STDOUT))
  try:
    deadline = time.monotonic() + 90
    while "step 20/" not in logs[0].read_text():
      assert time.monotonic() < deadline and procs[0].poll() is None, (
          logs[0].read_text()[-3000:])
      time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    # The survivor must give up by itself, within the collective timeout
    # plus start-up slack (the bound here only guards against a hang).
    code = procs[0].wait(timeout=KILL_TIMEOUT_S + 60)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  out = logs[0].read_text()
  assert code == 1, out[-3000:]
  assert "error: a peer worker failed or is unreachable" in out, out[-3000:]
  assert "Traceback" not in out
