"""Multi-worker sync: MultiWorkerMirroredStrategy across local processes.

Two worker processes (one replica each) must train exactly like one process
with two devices: same data per step, same all-reduce, same update, also in
buckets small enough that every layer travels in a bucket of its own, with
gradient accumulation and bfloat16 on the wire and in compute, unsharded and
with ZeRO-3. A dead peer must fail the other, not hang it; restarting both
workers (what the error tells the user to do) must resume as if nothing
happened; a preempted worker stops its peer at its step, and the launcher's
restart resumes both from there.

One story, told once (multi-process tests are the suite's slowest; each
cluster start is a TensorFlow start-up and a trace per worker):
1. two workers, started without the launcher (which would stop the survivor
   itself), unsharded; worker 1 is SIGKILLed, worker 0 must give up in one
   line;
2. `tools.launch --max_restarts` reruns the command with ZeRO-3
   (`--shard=weights`: checkpoints are the same at every stage) and thread
   flags; it resumes from the last checkpoint of 1; a seeded random worker
   gets SIGTERM at a seeded random step, both save the same step and exit
   143;
3. the launcher restarts the cluster, which resumes from that step and
   finishes.
One process with two devices, unsharded, in one bucket, trains the same
steps uninterrupted: it must equal the workers at the last checkpoint of 1
and at the end (the math must not change). Every run uses --deterministic.
"""

import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO
from dist_loop import checkpoints, make_config
from dist_loop.summaries import LOGDIR, TRAIN
from helpers import make_trainer, variables
from tools import launch

# Long enough for a peer still tracing its first step on a loaded machine,
# short enough to wait out after the kill; the launched run only needs a
# bound that never fires on a slow machine.
KILL_TIMEOUT_S = 30
LAUNCH_TIMEOUT_S = 60
SEED = 20261201
RUN = dict(dataset="synthetic", model="mlp", global_batch_size=32,
           optimizer="adam", learning_rate=0.01, steps_per_loop=2,
           log_every=2, eval_every=100000, checkpoint_every=2, seed=0,
           grad_accum_steps=2, allreduce_compression="bf16",
           precision="mixed_bfloat16")
BUCKET_MB = 0.001  # Every layer's gradients in a bucket of their own.
# Every checkpoint kept: the killed run's last is compared at the end.
WORKERS = dict(num_devices=1, allreduce_bucket_mb=BUCKET_MB,
               max_checkpoints=100)
# The launched run: slowed down (sleeps only, the same updates), so that the
# test sees the step it waits for before the run is past the next one.
STRAGGLER = "0:5"
# Steps the launched run trains past the checkpoint it resumes from.
MORE_STEPS = 8
TIMEOUT_S = 420


def _flags(**overrides):
  return [f"--{k}={v}" for k, v in {**RUN, **WORKERS, **overrides}.items()]


def _wait(predicate, what, alive, text, timeout=300):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert alive() and time.monotonic() < deadline, (what, text()[-4000:])
    time.sleep(0.05)


def _killed_run(workdir, log_dir):
  """Two workers without the launcher, unsharded; worker 1 is killed once
  worker 0 logged step 4. Returns (worker 0's exit code, its log)."""
  spec = launch.cluster_spec(num_workers=2, num_ps=0)
  procs, logs = [], []
  for i in range(2):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_CONFIG": json.dumps({"cluster": spec,
                                    "task": {"type": "worker", "index": i}})}
    logs.append(log_dir / f"killed-worker-{i}.log")
    with open(logs[i], "w") as log:
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "experiments.train",
           *_flags(train_steps=100000, shard="none",
                   collective_timeout_s=KILL_TIMEOUT_S),
           "--deterministic", f"--workdir={workdir}"], cwd=REPO, env=env,
          stdout=log, stderr=subprocess.STDOUT))
  try:
    _wait(lambda: "step 4/" in logs[0].read_text(), "step 4",
          lambda: procs[0].poll() is None, logs[0].read_text)
    procs[1].send_signal(signal.SIGKILL)
    # The survivor must give up by itself, within the collective timeout
    # plus slack (the bound here only guards against a hang).
    code = procs[0].wait(timeout=KILL_TIMEOUT_S + 60)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return code, logs[0].read_text()


class Cluster:
  """The launcher, running; its output collected as it comes."""

  def __init__(self, workdir, train_steps):
    self.workdir = workdir
    self.process = subprocess.Popen(
        [sys.executable, "-m", "tools.launch", "--num_workers=2",
         "--max_restarts=5", f"--timeout_s={TIMEOUT_S - 20}", "--",
         sys.executable, "-m", "experiments.train",
         *_flags(train_steps=train_steps, shard="weights",
                 collective_timeout_s=LAUNCH_TIMEOUT_S, intra_op_threads=1,
                 inter_op_threads=2, straggler=STRAGGLER),
         "--deterministic", f"--workdir={workdir}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    self.lines = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.process.stdout:
      self.lines.append(line.rstrip("\n"))

  def wait_for(self, predicate, what):
    _wait(predicate, what, lambda: self.process.poll() is None, self.output)

  def pids(self, attempt):
    """The two workers' PIDs in attempt `attempt` (0-based)."""
    started = [int(m.group(1)) for line in list(self.lines)
               for m in [re.search(r"started worker:\d \(pid (\d+)\)", line)]
               if m]
    return started[2 * attempt:2 * attempt + 2]

  def attempt_log(self, worker, attempt):
    """Worker `worker`'s log of attempt `attempt` (the launcher heads each
    restart's part of every log)."""
    path = os.path.join(self.workdir, "logs", f"worker-{worker}.log")
    if not os.path.exists(path):
      return ""
    with open(path, encoding="utf-8") as f:
      parts = re.split(r"^\[launch\] restart \d+ of \d+$", f.read(),
                       flags=re.M)
    return parts[attempt] if attempt < len(parts) else ""

  def output(self):
    return "\n".join(self.lines)


def _progress(log):
  steps = [int(s) for s in re.findall(r" step (\d+)/", log)]
  return max(steps, default=-1)


def _resumed_from(log):
  found = re.findall(r"Resumed from \S*ckpt-(\d+)", log)
  return int(found[-1]) if found else 0


def _preempted_run(workdir, train_steps):
  """The launched run: SIGTERM to a seeded random worker of its first
  attempt; the second finishes. Returns (cluster, exit code, (worker,
  at least at step))."""
  rng = random.Random(SEED)
  cluster = Cluster(str(workdir), train_steps)
  try:
    cluster.wait_for(lambda: len(cluster.pids(0)) == 2, "the workers start")
    # Its first step line comes after its restore: where it resumed.
    cluster.wait_for(lambda: _progress(cluster.attempt_log(0, 0)) > 0,
                     "the first step")
    target = _resumed_from(cluster.attempt_log(0, 0)) + rng.choice((2, 4))
    worker = rng.randrange(2)
    cluster.wait_for(lambda: _progress(cluster.attempt_log(0, 0)) >= target,
                     f"step {target}")
    os.kill(cluster.pids(0)[worker], signal.SIGTERM)
    cluster.wait_for(lambda: any("restart 1 of 5:" in line
                                 for line in list(cluster.lines)),
                     "the restart")
    code = cluster.process.wait(timeout=TIMEOUT_S)
  finally:
    if cluster.process.poll() is None:
      cluster.process.kill()  # Its tasks die with it (PDEATHSIG).
      cluster.process.wait()
  cluster._reader.join(timeout=5)  # pylint: disable=protected-access
  return cluster, code, (worker, target)


@pytest.fixture(name="story", scope="module")
def _story(tmp_path_factory):
  root = tmp_path_factory.mktemp("mw")
  workdir = root / "run"
  killed_code, killed_log = _killed_run(workdir, root)
  saved = tf.train.latest_checkpoint(
      str(workdir / checkpoints.CHECKPOINT_DIR))
  last = int(saved.rsplit("-", 1)[-1])
  cluster, code, preempted = _preempted_run(workdir, last + MORE_STEPS)
  return dict(workdir=str(workdir), killed_code=killed_code,
              killed_log=killed_log, last=last, cluster=cluster, code=code,
              preempted=preempted)


def test_a_killed_worker_fails_the_other_with_a_clear_error(story):
  out = story["killed_log"]
  assert story["killed_code"] == 1, out[-3000:]
  assert "error: a peer worker failed or is unreachable" in out, out[-3000:]
  assert "Traceback" not in out


def test_two_workers_equal_one_process_with_two_devices(story):
  """Unsharded at the last checkpoint before the kill; after a resume in
  ZeRO-3, a preemption and a second resume, at the end."""
  cluster, last = story["cluster"], story["last"]
  assert story["code"] == 0, cluster.output()[-4000:]
  assert last >= 2
  config = make_config(workdir=story["workdir"], num_devices=1,
                       train_steps=last + MORE_STEPS, **RUN)
  local = make_trainer(make_config(
      workdir=story["workdir"], num_devices=2, allreduce_bucket_mb=0,
      train_steps=last + MORE_STEPS, **RUN))
  for step, steps in ((last, last), (last + MORE_STEPS, MORE_STEPS)):
    local.train(steps)
    path = os.path.join(story["workdir"], checkpoints.CHECKPOINT_DIR,
                        f"ckpt-{step}")
    workers = checkpoints.load_model(config, path).trainable_variables
    for a, b in zip(variables(local), workers):
      np.testing.assert_allclose(a, np.asarray(b), atol=1e-6, rtol=0)
  local.close()


def test_sigterm_to_one_worker_saves_the_same_step_on_both(story):
  cluster = story["cluster"]
  assert story["code"] == 0, cluster.output()[-4000:]
  restarts = [line for line in cluster.lines if "; restart " in line]
  assert len(restarts) == 1 and "(exit code 143)" in restarts[0], restarts
  saved = []
  for worker in (0, 1):
    log = cluster.attempt_log(worker, 0)
    steps = re.findall(r"step (\d+)  saved checkpoint", log)
    assert steps, log[-3000:]
    saved.append(int(steps[-1]))
    assert ("SIGTERM: saving a checkpoint" in log
            or "Another worker got SIGTERM" in log), log[-3000:]
  assert saved[0] == saved[1] >= story["preempted"][1]
  # The restart resumed both workers from that very checkpoint, and neither
  # attempt ended in a traceback.
  for worker in (0, 1):
    assert _resumed_from(cluster.attempt_log(worker, 1)) == saved[0]
    assert not any("Traceback" in cluster.attempt_log(worker, attempt)
                   for attempt in (0, 1))


def test_thread_flags_work_with_multi_worker_runs(story):
  """The launched run had --intra_op_threads and --inter_op_threads."""
  out = story["cluster"].output()
  assert story["code"] == 0, out[-4000:]
  assert "thread counts must be set" not in out
  assert f"[worker:1] done: step {story['last'] + MORE_STEPS}" in out


def test_both_workers_resumed_and_only_the_chief_wrote(story):
  workdir, last, cluster = story["workdir"], story["last"], story["cluster"]
  for i in range(2):  # Not from step 0: from the killed run's checkpoint.
    log = cluster.attempt_log(i, 0)
    assert "Resumed from" in log and f"ckpt-{last}." in log, log[-3000:]
  assert f"[worker:1] done: step {last + MORE_STEPS}" in cluster.output()
  ckpt_dir = os.path.join(workdir, checkpoints.CHECKPOINT_DIR)
  assert not [n for n in os.listdir(ckpt_dir) if n.startswith("workertemp")]
  # One train event file per run (the killed one and the launcher's two
  # attempts): the chief's; the other worker's writers are no-ops.
  assert len(glob.glob(os.path.join(workdir, LOGDIR, TRAIN,
                                    "events.out.tfevents.*"))) == 3
