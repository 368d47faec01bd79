"""Multi-worker sync: MultiWorkerMirroredStrategy across local processes.

Two worker processes (one replica each) must train exactly like one process
with two devices: same data per step, same all-reduce, same update, also in
buckets small enough that every layer travels in a bucket of its own, with
gradient accumulation and bfloat16 on the wire and in compute, unsharded and
with ZeRO-3. A preempted worker stops its peer at its step; rerunning both
workers resumes as if nothing happened; a dead peer must fail the other, not
hang it.

One story, told once (multi-process tests are the suite's slowest; each
cluster start is a TensorFlow start-up and a trace per worker, so there are
two):
1. `tools.launch` runs the workers unsharded, with thread flags and
   `--async_checkpoint`; a seeded random worker gets SIGTERM at a seeded
   random step, both save the same step (in the background, waited for)
   and exit 143, and so does the launcher (`--max_restarts=0`: that
   the launcher restarts a failed cluster with the same command is
   test_launch.py's);
2. the same command, rerun without the launcher (which would stop the
   survivor itself) with ZeRO-3 (`--shard=weights`: checkpoints are the same
   at every stage), resumes both workers from that step; worker 1 is
   SIGKILLed, worker 0 must give up in one line.
One process with two devices, unsharded, in one bucket, trains the same
steps uninterrupted: it must equal the workers at the checkpoint of 1 and at
the last checkpoint of 2 (the math must not change). Every run uses
--deterministic.
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
from dist_loop import make_config
from dist_loop.control import weights
from dist_loop.runtime import checkpoints
from dist_loop.runtime.summaries import LOGDIR, TRAIN
from helpers import make_trainer, variables
from tools import launch

# The killed run's bound: long enough for a peer still tracing its first
# step after the resume on a loaded machine (the survivor of a SIGKILL hears
# of it from the coordination service's heartbeats, within seconds); the
# launched run only needs a bound that never fires on a slow machine.
KILL_TIMEOUT_S = 30
LAUNCH_TIMEOUT_S = 60
SEED = 20261201
RUN = dict(dataset="synthetic", model="mlp", global_batch_size=32,
           optimizer="adam", learning_rate=0.01, steps_per_loop=2,
           log_every=2, eval_every=100000, checkpoint_every=2, seed=0,
           grad_accum_steps=2, allreduce_compression="bf16",
           precision="mixed_bfloat16", train_steps=100000)
BUCKET_MB = 0.001  # Every layer's gradients in a bucket of their own.
# Every checkpoint kept: the launched run's last is compared at the end.
WORKERS = dict(num_devices=1, allreduce_bucket_mb=BUCKET_MB,
               max_checkpoints=100)
# The launched run: slowed down (sleeps only, the same updates), so that the
# test sees the step it waits for before the run is past the next one.
STRAGGLER = "0:5"
# Steps the killed run trains past the checkpoint it resumes from.
MORE_STEPS = 4
TIMEOUT_S = 420


def _flags(**overrides):
  return [f"--{k}={v}" for k, v in {**RUN, **WORKERS, **overrides}.items()]


def _wait(predicate, what, alive, text, timeout=300):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert alive() and time.monotonic() < deadline, (what, text()[-4000:])
    time.sleep(0.05)


def _progress(log):
  steps = [int(s) for s in re.findall(r" step (\d+)/", log)]
  return max(steps, default=-1)


def _resumed_from(log):
  found = re.findall(r"Resumed from \S*ckpt-(\d+)", log)
  return int(found[-1]) if found else 0


class Cluster:
  """The launcher, running; its output collected as it comes."""

  def __init__(self, workdir):
    self.workdir = workdir
    self.process = subprocess.Popen(
        [sys.executable, "-m", "tools.launch", "--num_workers=2",
         "--max_restarts=0", f"--timeout_s={TIMEOUT_S - 20}", "--",
         sys.executable, "-m", "experiments.train",
         *_flags(shard="none", collective_timeout_s=LAUNCH_TIMEOUT_S,
                 intra_op_threads=1, inter_op_threads=2,
                 straggler=STRAGGLER, async_checkpoint=True),
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

  def pids(self):
    """The two workers' PIDs."""
    return [int(m.group(1)) for line in list(self.lines)
            for m in [re.search(r"started worker:\d \(pid (\d+)\)", line)]
            if m]

  def log(self, worker):
    path = os.path.join(self.workdir, "logs", f"worker-{worker}.log")
    if not os.path.exists(path):
      return ""
    with open(path, encoding="utf-8") as f:
      return f.read()

  def output(self):
    return "\n".join(self.lines)


def _preempted_run(workdir):
  """The launched run: SIGTERM to a seeded random worker at a seeded random
  step. Returns (cluster, exit code, (worker, at least at step))."""
  rng = random.Random(SEED)
  cluster = Cluster(str(workdir))
  try:
    cluster.wait_for(lambda: len(cluster.pids()) == 2, "the workers start")
    target = rng.choice((2, 4))
    worker = rng.randrange(2)
    cluster.wait_for(lambda: _progress(cluster.log(0)) >= target,
                     f"step {target}")
    os.kill(cluster.pids()[worker], signal.SIGTERM)
    code = cluster.process.wait(timeout=TIMEOUT_S)
  finally:
    if cluster.process.poll() is None:
      cluster.process.kill()  # Its tasks die with it (PDEATHSIG).
      cluster.process.wait()
  cluster._reader.join(timeout=5)  # pylint: disable=protected-access
  return cluster, code, (worker, target)


def _killed_run(workdir, log_dir, kill_at):
  """Two workers without the launcher, with ZeRO-3; worker 1 is killed
  once worker 0 logged step `kill_at`. Returns (worker 0's exit code, both
  logs)."""
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
           *_flags(shard="weights", collective_timeout_s=KILL_TIMEOUT_S),
           "--deterministic", f"--workdir={workdir}"], cwd=REPO, env=env,
          stdout=log, stderr=subprocess.STDOUT))
  try:
    _wait(lambda: f"step {kill_at}/" in logs[0].read_text(),
          f"step {kill_at}", lambda: procs[0].poll() is None,
          logs[0].read_text)
    procs[1].send_signal(signal.SIGKILL)
    # The survivor must give up by itself, within the collective timeout
    # plus slack (the bound here only guards against a hang).
    code = procs[0].wait(timeout=KILL_TIMEOUT_S + 60)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return code, [log.read_text() for log in logs]


def _checkpoint_step(workdir):
  saved = tf.train.latest_checkpoint(
      str(workdir / checkpoints.CHECKPOINT_DIR))
  return int(saved.rsplit("-", 1)[-1]) if saved else 0


@pytest.fixture(name="story", scope="module")
def _story(tmp_path_factory):
  root = tmp_path_factory.mktemp("mw")
  workdir = root / "run"
  cluster, code, preempted = _preempted_run(workdir)
  saved = _checkpoint_step(workdir)
  workertemp = [n for n in os.listdir(workdir / checkpoints.CHECKPOINT_DIR)
                if n.startswith("workertemp")]
  killed_code, killed_logs = _killed_run(workdir, root, saved + MORE_STEPS)
  return dict(workdir=str(workdir), cluster=cluster, code=code,
              preempted=preempted, saved=saved, workertemp=workertemp,
              killed_code=killed_code, killed_logs=killed_logs,
              last=_checkpoint_step(workdir))


def test_sigterm_to_one_worker_saves_the_same_step_on_both(story):
  cluster = story["cluster"]
  # The launcher ends with the preempted worker's code, without a restart.
  assert story["code"] == 143, cluster.output()[-4000:]
  assert not [line for line in cluster.lines if "; restart " in line]
  saved = []
  for worker in (0, 1):
    log = cluster.log(worker)
    steps = re.findall(r"step (\d+)  saved checkpoint", log)
    assert steps, log[-3000:]
    saved.append(int(steps[-1]))
    assert ("SIGTERM: saving a checkpoint" in log
            or "Another worker got SIGTERM" in log), log[-3000:]
    assert "Traceback" not in log
  assert saved[0] == saved[1] == story["saved"] >= story["preempted"][1]


def test_thread_flags_work_with_multi_worker_runs(story):
  """The launched run had --intra_op_threads and --inter_op_threads."""
  out = story["cluster"].output()
  assert "thread counts must be set" not in out
  for worker in (0, 1):
    assert _progress(story["cluster"].log(worker)) >= 2


def test_each_workers_start_line_names_the_cluster(story):
  """Not "sync on 1 device": the run's workers, then this process's own."""
  for worker in (0, 1):
    log = story["cluster"].log(worker)
    assert (f"sync on 2 workers, this one worker:{worker} on 1 device"
            in log), log[-3000:]


def test_a_rerun_resumes_both_workers_and_only_the_chief_writes(story):
  workdir, saved = story["workdir"], story["saved"]
  for log in story["killed_logs"]:  # From the preempted run's checkpoint.
    assert _resumed_from(log) == saved, log[-3000:]
    assert "Traceback" not in log
  assert story["last"] > saved
  # Nothing left of worker 1's saves in a run that ended well.
  assert not story["workertemp"]
  # One train event file per run (the launched one and the killed one):
  # the chief's; the other worker's writers are no-ops.
  assert len(glob.glob(os.path.join(workdir, LOGDIR, TRAIN,
                                    "events.out.tfevents.*"))) == 2


def test_a_killed_worker_fails_the_other_with_a_clear_error(story):
  out = story["killed_logs"][0]
  assert story["killed_code"] == 1, out[-3000:]
  errors = [line for line in out.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, out[-3000:]
  assert errors[0].startswith(
      "error: a peer worker failed or is unreachable"), out[-3000:]
  assert "Traceback" not in out


def test_two_workers_equal_one_process_with_two_devices(story):
  """Unsharded at the preempted run's checkpoint; after a resume in
  ZeRO-3, at the last checkpoint before the kill."""
  saved, last = story["saved"], story["last"]
  assert saved >= 2 and last > saved
  config = make_config(workdir=story["workdir"], num_devices=1, **RUN)
  local = make_trainer(make_config(
      workdir=story["workdir"], num_devices=2, allreduce_bucket_mb=0, **RUN))
  for step, steps in ((saved, saved), (last, last - saved)):
    local.train(steps)
    path = os.path.join(story["workdir"], checkpoints.CHECKPOINT_DIR,
                        f"ckpt-{step}")
    workers = weights.load_model(config, path).trainable_variables
    for a, b in zip(variables(local), workers):
      np.testing.assert_allclose(a, np.asarray(b), atol=1e-6, rtol=0)
  local.close()
