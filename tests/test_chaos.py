"""Chaos: a two-worker run that is killed again and again finishes exactly
as an uninterrupted run, and a preempted worker stops its peer at its step.

One story, told once (it is the costly test of the reliability suite): a
two-worker MultiWorkerMirroredStrategy run under `tools.launch
--max_restarts=5`, with --deterministic. A seeded random worker is SIGKILLed
at a seeded random step, three times; then a seeded random worker gets
SIGTERM (a preemption), and both workers save the same step and exit. The
launcher restarts the whole cluster after each of the four, and the run
must finish at its last step with the variables of an uninterrupted run (a
process with two devices computes the same steps; tests/test_multiworker.py).
"""

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, checkpoint_variables, max_diff
from dist_loop import make_config, train

# Each disruption lands 10 to 20 steps (and a loop or two more while it is
# on its way) after the step its attempt resumed from, so that every attempt
# saves a checkpoint first, and the four leave the final attempt steps to
# train.
STEPS = 100
SEED = 20261201
KILLS = 3
RUN = dict(dataset="synthetic", model="mlp", global_batch_size=32,
           optimizer="adam", learning_rate=0.01, steps_per_loop=5,
           log_every=5, eval_every=100000, checkpoint_every=5, seed=0)
TIMEOUT_S = 240


class Cluster:
  """The launcher, running; its output collected as it comes."""

  def __init__(self, workdir):
    self.workdir = workdir
    args = [f"--{k}={v}" for k, v in {**RUN, "train_steps": STEPS}.items()]
    self.process = subprocess.Popen(
        [sys.executable, "-m", "tools.launch", "--num_workers=2",
         "--max_restarts=5", f"--timeout_s={TIMEOUT_S - 20}", "--",
         sys.executable, "-m", "experiments.train", *args, "--num_devices=1",
         "--deterministic", "--collective_timeout_s=10",
         f"--workdir={workdir}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    self.lines = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.process.stdout:
      self.lines.append(line.rstrip("\n"))

  def wait_for(self, predicate, what, timeout=90):
    deadline = time.monotonic() + timeout
    while not predicate():
      assert self.process.poll() is None, (what, self.output()[-4000:])
      assert time.monotonic() < deadline, (what, self.output()[-4000:])
      time.sleep(0.02)

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


@pytest.fixture(name="story", scope="module")
def _story(tmp_path_factory):
  """Runs the chaos; returns what happened, and the reference variables."""
  root = tmp_path_factory.mktemp("chaos")
  rng = random.Random(SEED)
  cluster = Cluster(str(root / "run"))
  disruptions = []  # (attempt, worker, signal, at least at step)
  try:
    for attempt in range(KILLS + 1):
      sig = signal.SIGKILL if attempt < KILLS else signal.SIGTERM
      cluster.wait_for(lambda: len(cluster.pids(attempt)) == 2,
                       "the workers start")
      # Its first step line comes after its restore: where it resumed.
      cluster.wait_for(lambda: _progress(cluster.attempt_log(0, attempt)) > 0,
                       f"the first step of attempt {attempt}")
      start = _resumed_from(cluster.attempt_log(0, attempt))
      target = start + rng.choice((10, 15, 20))
      worker = rng.randrange(2)
      cluster.wait_for(
          lambda: _progress(cluster.attempt_log(0, attempt)) >= target,
          f"step {target} of attempt {attempt}")
      os.kill(cluster.pids(attempt)[worker], sig)
      disruptions.append((attempt, worker, sig, target))
      cluster.wait_for(
          lambda: any(f"restart {attempt + 1} of 5:" in line
                      for line in list(cluster.lines)),
          f"restart {attempt + 1}")
    code = cluster.process.wait(timeout=TIMEOUT_S)
  finally:
    if cluster.process.poll() is None:
      cluster.process.kill()  # Its tasks die with it (PDEATHSIG).
      cluster.process.wait()
  cluster._reader.join(timeout=5)  # pylint: disable=protected-access
  reference = make_config(workdir=str(root / "reference"), num_devices=2,
                          train_steps=STEPS,
                          **{**RUN, "checkpoint_every": STEPS})
  train.run(reference)
  return dict(cluster=cluster, code=code, disruptions=disruptions,
              reference=checkpoint_variables(reference),
              chaos=checkpoint_variables(
                  reference.replace(workdir=cluster.workdir)))


def test_killed_three_times_it_finishes_equal_to_an_uninterrupted_run(story):
  cluster = story["cluster"]
  assert story["code"] == 0, cluster.output()[-4000:]
  restarts = [line for line in cluster.lines if "; restart " in line]
  assert len(restarts) == KILLS + 1, restarts
  assert all("(killed by signal 9)" in line for line in restarts[:KILLS])
  assert "(exit code 143)" in restarts[KILLS]
  for worker in (0, 1):  # A survivor ends in one line, never a traceback.
    assert not any("Traceback" in cluster.attempt_log(worker, attempt)
                   for attempt in range(KILLS + 2))
  final = cluster.attempt_log(0, KILLS + 1)
  assert f"[worker:0] done: step {STEPS}" in cluster.output()
  assert _resumed_from(final) > 0, final[-3000:]
  assert max_diff(story["chaos"], story["reference"]) <= 1e-5


def test_sigterm_to_one_worker_saves_the_same_step_on_both(story):
  cluster = story["cluster"]
  preempted, _, _, _ = story["disruptions"][-1]
  saved = []
  for worker in (0, 1):
    log = cluster.attempt_log(worker, preempted)
    steps = re.findall(r"step (\d+)  saved checkpoint", log)
    assert steps, log[-3000:]
    saved.append(int(steps[-1]))
    assert ("SIGTERM: saving a checkpoint" in log
            or "Another worker got SIGTERM" in log), log[-3000:]
  assert saved[0] == saved[1]
  # The next attempt resumed both workers from that very checkpoint.
  for worker in (0, 1):
    assert _resumed_from(cluster.attempt_log(worker, preempted + 1)) == (
        saved[0])
