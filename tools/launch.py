r"""Starts a TensorFlow cluster of local processes, one per task.

    python -m tools.launch --num_workers=2 -- \
        python -m experiments.train --flagfile=experiments/configs/multiworker.flags \
        --workdir=runs/mw
    python -m tools.launch --num_workers=2 --num_ps=1 -- \
        python -m experiments.train --flagfile=experiments/configs/ps.flags \
        --workdir=runs/ps

Every task runs the same command; only its `TF_CONFIG` differs:

* `--num_ps=0`: a multi-worker cluster, `{"worker": [N addresses]}`; every
  worker trains (MultiWorkerMirroredStrategy), worker 0 is the chief.
* `--num_ps=P`: a parameter-server cluster, `{"chief": [1], "worker": [N],
  "ps": [P]}`. The chief is the coordinator and the only process that trains;
  workers and parameter servers are TensorFlow servers that run until they
  are stopped.

Each task's output goes to WORKDIR/logs/<task>.log (`--workdir` is read from
the command; `--log_dir` overrides) and, prefixed with `[task]`, to the
console. Ctrl-C is forwarded to every training task (in a PS cluster, the
servers are stopped once the chief has saved). The launcher exits 0 once every
training process exited 0 (then it stops the servers). If a task fails, it
stops the others, prints the tail of the failed task's log and exits with
that task's code; a failed worker of a parameter-server cluster is the one
exception: the coordinator moves its work to the other workers, so it is
reported and training goes on.

`--max_restarts=N` (as torchrun's): after a failure, stop every task, wait
for the cluster's ports to free, and start the whole cluster again with the
same command (and the same TF_CONFIG, unless a port was taken meanwhile);
every task resumes from the last checkpoint. One line per restart says why,
and which of N it is; the (N+1)-th failure ends the launcher with that
task's exit code. A lost parameter server, or a worker's SIGTERM exit, is a
failure like any other. On real hosts, run the train command itself with a
hand-written TF_CONFIG per host (README, "Multiple processes and hosts").
This file does not import TensorFlow.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, Optional, Sequence

# free_ports is re-exported: tests reserve ports the way the launcher does.
from tools.local_cluster import (Task, cluster_spec, free_ports,  # noqa: F401
                                 wait_for_ports)

STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this.
# Before a restart: a task stuck in a collective with a dead peer cannot
# act on SIGTERM until the collective times out, and nothing is left to save.
RESTART_GRACE_S = 3.0
PORT_WAIT_S = 15.0
POLL_S = 0.2


def workdir_of(command: Sequence[str]) -> Optional[str]:
  """The value of `--workdir` in a command, if it has one."""
  for i, arg in enumerate(command):
    if arg.startswith("--workdir="):
      return arg.split("=", 1)[1]
    if arg == "--workdir" and i + 1 < len(command):
      return command[i + 1]
  return None


class Launcher:
  """Starts the tasks, watches them, and stops (or restarts) them all on
  failure.

  Args:
    command: the command every task runs.
    num_workers: worker tasks.
    num_ps: parameter-server tasks; > 0 adds a chief (the coordinator).
    log_dir: where WORKER-i.log etc. go.
    timeout_s: stop everything and fail after this long (0: no limit).
    quiet: do not echo task output to the console (it is still logged).
    max_restarts: restarts of the whole cluster after a failure.
  """

  def __init__(self, command: Sequence[str], num_workers: int, num_ps: int = 0,
               log_dir: str = "logs", timeout_s: float = 0, quiet=False,
               max_restarts: int = 0):
    if num_workers < 1 or num_ps < 0 or max_restarts < 0:
      raise ValueError("need --num_workers >= 1, --num_ps >= 0 and "
                       "--max_restarts >= 0")
    self.command = list(command)
    self.num_workers, self.num_ps = num_workers, num_ps
    self.spec = cluster_spec(num_workers, num_ps)
    self.log_dir = log_dir
    self.timeout_s = timeout_s
    self.quiet = quiet
    self.max_restarts = max_restarts
    self.restarts = 0
    self.tasks = self._make_tasks()
    # In a PS cluster the coordinator re-runs a lost worker's steps elsewhere.
    self.tolerated_jobs = {"worker"} if num_ps else set()
    self._lock = threading.Lock()
    self._interrupted = False

  def _make_tasks(self) -> Dict[str, Task]:
    tasks = {}
    for job, addresses in self.spec.items():
      for i in range(len(addresses)):
        trains = job == "chief" or (job == "worker" and not self.num_ps)
        tasks[f"{job}:{i}"] = Task(job, i, trains)
    return tasks

  def start(self) -> None:
    os.makedirs(self.log_dir, exist_ok=True)
    header = (f"[launch] restart {self.restarts} of {self.max_restarts}"
              if self.restarts else "")
    for task in self.tasks.values():
      tf_config = json.dumps({"cluster": self.spec,
                              "task": {"type": task.job, "index": task.index}})
      env = {**os.environ, "TF_CONFIG": tf_config, "PYTHONUNBUFFERED": "1"}
      log_path = os.path.join(self.log_dir,
                              f"{task.job}-{task.index}.log")
      task.start(self.command, env, log_path, self._lock, self.quiet, header)
      self._say(f"started {task.name} (pid {task.process.pid}), log "
                f"{log_path}")

  def interrupt(self) -> None:
    """Forwards Ctrl-C (SIGINT) to every training task; `wait` stops the
    servers once those have saved their checkpoint, then returns 130.

    Servers (a PS cluster's workers and parameter servers) hold the
    variables the chief saves on Ctrl-C, so they must outlive it.
    """
    self._interrupted = True
    for task in self.tasks.values():
      if task.trains:
        task.signal(signal.SIGINT)

  def wait(self) -> int:
    """Watches the tasks until training ends or fails for good; returns an
    exit code."""
    deadline = time.monotonic() + self.timeout_s if self.timeout_s else None
    interrupted_at = None
    while True:
      if self._interrupted:
        interrupted_at = interrupted_at or time.monotonic()
        if (all(t.poll() is not None for t in self.tasks.values() if t.trains)
            or time.monotonic() - interrupted_at > 3 * STOP_GRACE_S):
          self.stop()
          return 130
      failed = self._check_failures()
      if failed is not None:
        task, code = failed
        if self.restarts < self.max_restarts and not self._interrupted:
          self._restart(task, code)
          continue
        self._report(task, code)
        self.stop()
        return code if code > 0 else 128 - code  # -N: killed by signal N.
      trainers = [t for t in self.tasks.values() if t.trains]
      if all(t.poll() == 0 for t in trainers):
        self.stop()
        self._say("training finished; all tasks stopped")
        return 0
      if deadline is not None and time.monotonic() > deadline:
        self._say(f"timed out after {self.timeout_s:.0f} s; stopping all tasks")
        self.stop()
        return 124
      time.sleep(POLL_S)

  def _check_failures(self):
    """The first task that failed since the last look, as (task, exit
    code), or None. A tolerated failure is reported here."""
    for task in self.tasks.values():
      code = task.poll()
      if code in (None, 0) or task.stopped or task.reported:
        continue
      task.reported = True
      if self._interrupted:
        continue
      if task.job in self.tolerated_jobs:
        self._report(task, code)
        self._say(f"{task.name} failed; the coordinator moves its work to "
                  "the other workers, training goes on")
        continue
      return task, code
    return None

  def _restart(self, task: Task, code: int) -> None:
    """Stops every task and starts the cluster again, on the same ports
    once they are free (new ones if they stay taken)."""
    self.restarts += 1
    self._say(f"{task.name} failed ({_how(code)}); restart {self.restarts} "
              f"of {self.max_restarts}: stopping every task and restarting "
              f"the cluster (log {task.log_path})")
    self.stop(RESTART_GRACE_S)
    if not wait_for_ports(self.spec, PORT_WAIT_S):
      self.spec = cluster_spec(self.num_workers, self.num_ps)
      self._say(f"the cluster's ports stayed taken for {PORT_WAIT_S:.0f} s; "
                "restarting on new ports")
    self.tasks = self._make_tasks()
    self.start()

  def _report(self, task: Task, code: int) -> None:
    lines = "\n".join(f"  | {line}" for line in task.tail())
    self._say(f"{task.name} failed ({_how(code)}); last lines of "
              f"{task.log_path}:\n{lines}")

  def stop(self, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every running task, then SIGKILL after `grace_s`."""
    for task in self.tasks.values():
      if task.poll() is None:
        task.stopped = True
        task.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for task in self.tasks.values():
      try:
        task.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
      except subprocess.TimeoutExpired:
        task.signal(signal.SIGKILL)
        task.process.wait(timeout=STOP_GRACE_S)
    for task in self.tasks.values():
      task.tail()  # Let the log pumps drain.

  def _say(self, message: str) -> None:
    with self._lock:
      print(f"[launch] {message}", flush=True)


def _how(code: int) -> str:
  return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--" not in argv:
    print("usage: python -m tools.launch --num_workers=N [--num_ps=P] -- "
          "COMMAND...", file=sys.stderr)
    return 2
  split = argv.index("--")
  parser = argparse.ArgumentParser(prog="python -m tools.launch")
  parser.add_argument("--num_workers", type=int, required=True)
  parser.add_argument("--num_ps", type=int, default=0)
  parser.add_argument("--log_dir", default=None,
                      help="default: WORKDIR/logs, WORKDIR from --workdir")
  parser.add_argument("--timeout_s", type=float, default=0,
                      help="stop everything and exit 124 after this long")
  parser.add_argument("--max_restarts", type=int, default=0,
                      help="after a failure, restart the whole cluster up "
                      "to N times (0: stop at the first failure)")
  args = parser.parse_args(argv[:split])
  command = argv[split + 1:]
  if not command:
    parser.error("no command after --")
  log_dir = args.log_dir
  if log_dir is None:
    workdir = workdir_of(command)
    if workdir is None:
      parser.error("the command has no --workdir; pass --log_dir")
    log_dir = os.path.join(workdir, "logs")
  try:
    launcher = Launcher(command, args.num_workers, args.num_ps, log_dir,
                        args.timeout_s, max_restarts=args.max_restarts)
  except ValueError as e:
    parser.error(str(e))
  signal.signal(signal.SIGINT, lambda *_: launcher.interrupt())
  signal.signal(signal.SIGTERM, lambda *_: launcher.interrupt())
  launcher.start()
  return launcher.wait()


if __name__ == "__main__":
  sys.exit(main())
