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
reported and training goes on. On real hosts, run the train command itself
with a hand-written TF_CONFIG per host (README, "Multiple processes and
hosts"). This file does not import TensorFlow.
"""

import argparse
import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

# free_ports is re-exported: tests reserve ports the way the launcher does.
from tools.local_cluster import cluster_spec, free_ports  # noqa: F401

TAIL_LINES = 25
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this.
POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


def workdir_of(command: Sequence[str]) -> Optional[str]:
  """The value of `--workdir` in a command, if it has one."""
  for i, arg in enumerate(command):
    if arg.startswith("--workdir="):
      return arg.split("=", 1)[1]
    if arg == "--workdir" and i + 1 < len(command):
      return command[i + 1]
  return None


def _die_with_parent():
  """Runs in the child: the kernel kills it if the launcher dies (Linux)."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):
    pass


class Task:
  """One process of the cluster, its log file and its console prefix."""

  def __init__(self, job: str, index: int, trains: bool):
    self.job, self.index, self.trains = job, index, trains
    self.name = f"{job}:{index}"
    self.process: Optional[subprocess.Popen] = None
    self.log_path = ""
    self.stopped = False  # We stopped it: its exit code is not a failure.
    self.reported = False
    self._tail = collections.deque(maxlen=TAIL_LINES)
    self._reader: Optional[threading.Thread] = None

  def start(self, command, env, log_path, console_lock, quiet):
    self.log_path = log_path
    self.process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True, bufsize=1,
        start_new_session=True,  # Signals reach it only through us.
        preexec_fn=_die_with_parent)
    self._reader = threading.Thread(
        target=self._pump, args=(console_lock, quiet), daemon=True,
        name=f"log-{self.name}")
    self._reader.start()

  def _pump(self, console_lock, quiet):
    with open(self.log_path, "a", encoding="utf-8") as log:
      for line in self.process.stdout:
        log.write(line)
        log.flush()
        self._tail.append(line.rstrip("\n"))
        if not quiet:
          with console_lock:
            print(f"[{self.name}] {line}", end="", flush=True)

  def poll(self) -> Optional[int]:
    return self.process.poll()

  def signal(self, sig) -> None:
    if self.process.poll() is None:
      try:
        os.killpg(self.process.pid, sig)
      except ProcessLookupError:
        pass

  def tail(self) -> List[str]:
    if self._reader is not None:
      self._reader.join(timeout=2.0)  # The pipe closes when the task exits.
    return list(self._tail)


class Launcher:
  """Starts the tasks, watches them, and stops them all on failure.

  Args:
    command: the command every task runs.
    num_workers: worker tasks.
    num_ps: parameter-server tasks; > 0 adds a chief (the coordinator).
    log_dir: where WORKER-i.log etc. go.
    timeout_s: stop everything and fail after this long (0: no limit).
    quiet: do not echo task output to the console (it is still logged).
  """

  def __init__(self, command: Sequence[str], num_workers: int, num_ps: int = 0,
               log_dir: str = "logs", timeout_s: float = 0, quiet=False):
    if num_workers < 1 or num_ps < 0:
      raise ValueError("need --num_workers >= 1 and --num_ps >= 0")
    self.command = list(command)
    self.spec = cluster_spec(num_workers, num_ps)
    self.log_dir = log_dir
    self.timeout_s = timeout_s
    self.quiet = quiet
    ps_cluster = num_ps > 0
    self.tasks: Dict[str, Task] = {}
    for job, addresses in self.spec.items():
      for i in range(len(addresses)):
        trains = job == "chief" or (job == "worker" and not ps_cluster)
        task = Task(job, i, trains)
        self.tasks[task.name] = task
    # In a PS cluster the coordinator re-runs a lost worker's steps elsewhere.
    self.tolerated_jobs = {"worker"} if ps_cluster else set()
    self._lock = threading.Lock()
    self._interrupted = False

  def start(self) -> None:
    os.makedirs(self.log_dir, exist_ok=True)
    for task in self.tasks.values():
      tf_config = json.dumps({"cluster": self.spec,
                              "task": {"type": task.job, "index": task.index}})
      env = {**os.environ, "TF_CONFIG": tf_config, "PYTHONUNBUFFERED": "1"}
      log_path = os.path.join(self.log_dir,
                              f"{task.job}-{task.index}.log")
      task.start(self.command, env, log_path, self._lock, self.quiet)
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
    """Watches the tasks until training ends or fails; returns an exit code."""
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
        return failed
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

  def _check_failures(self) -> Optional[int]:
    for task in self.tasks.values():
      code = task.poll()
      if code in (None, 0) or task.stopped or task.reported:
        continue
      task.reported = True
      if self._interrupted:
        continue
      self._report(task, code)
      if task.job in self.tolerated_jobs:
        self._say(f"{task.name} failed; the coordinator moves its work to "
                  "the other workers, training goes on")
        continue
      self.stop()
      return code if code > 0 else 128 - code  # -N: killed by signal N.
    return None

  def _report(self, task: Task, code: int) -> None:
    how = (f"exit code {code}" if code >= 0
           else f"killed by signal {-code}")
    lines = "\n".join(f"  | {line}" for line in task.tail())
    self._say(f"{task.name} failed ({how}); last lines of {task.log_path}:\n"
              f"{lines}")

  def stop(self) -> None:
    """SIGTERM to every running task, then SIGKILL after a grace period."""
    for task in self.tasks.values():
      if task.poll() is None:
        task.stopped = True
        task.signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
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
                        args.timeout_s)
  except ValueError as e:
    parser.error(str(e))
  signal.signal(signal.SIGINT, lambda *_: launcher.interrupt())
  signal.signal(signal.SIGTERM, lambda *_: launcher.interrupt())
  launcher.start()
  return launcher.wait()


if __name__ == "__main__":
  sys.exit(main())
