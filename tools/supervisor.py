"""The supervisor of a local cluster: `Launcher` starts one process per
task, watches them, and on a failure stops them all, or restarts the whole
cluster (`--max_restarts`). `tools/launch.py` is its command line and says
what each rule is for; `tools/local_cluster.py` has the addresses, the cores
and the processes. What it does (starts, failures, stops, waits, its exit)
it appends to its record, `dist_loop/runtime/launch_record.py`, from which
goodput splits the downtime of a restart. A task whose command is this
interpreter running a module is forked by a fork server that has imported
TensorFlow (`tools/fork_server.py`), started with the first such task and
kept across restarts. This file does not import TensorFlow.
"""

import json
import os
import signal
import subprocess
import threading
import time
from typing import Dict, Optional, Sequence

from dist_loop.runtime import console, files
from tools.fork_server import (READY_TIMEOUT_S, ForkServer, ForkServerError,
                               module_command)
from tools.local_cluster import (Task, available_cpus, check_open_files,
                                 cluster_spec, cpu_sets, wait_for_ports)

STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this.
# Exit codes a restart cannot change: a run that ended diverged (3,
# `errors.DivergedError`) diverges again from the same checkpoint, so the
# launcher reports it at once instead of retrying.
FINAL_CODES = (3,)
# A usage error is the same on every restart: argparse's (and this
# launcher's) exit code 2, or absl's exit 1 with this line (a misspelt flag,
# a value the flag parser refuses).
USAGE_CODE = 2
ABSL_USAGE_LINE = "FATAL Flags parsing error"

# Before a restart: a task stuck in a collective with a dead peer cannot
# act on SIGTERM until the collective times out, and nothing is left to save.
RESTART_GRACE_S = 3.0
PORT_WAIT_S = 15.0
POLL_S = 0.2


class LaunchError(Exception):
  """Bad input to the launcher; the message names the fix."""


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
    cpus_per_task: cores per task; None: `auto`, 0: unpinned
      (tools/launch.py).
    verbosity: as `--verbosity` (tools/launch.py).
    record: the file its events are appended to
      (`dist_loop/runtime/launch_record.py`), or None.
    preload: the modules the fork server imports before it forks a task
      whose command is this interpreter running a module
      (`tools/fork_server.py`); empty: every task starts as a new process.

  Raises:
    LaunchError: a bad number, or more cores asked for than there are.
  """

  def __init__(self, command: Sequence[str], num_workers: int, num_ps: int = 0,
               log_dir: str = "logs", timeout_s: float = 0, quiet=False,
               max_restarts: int = 0, cpus_per_task: Optional[int] = None,
               verbosity: int = 0, record: Optional[str] = None,
               preload: Sequence[str] = ("tensorflow",)):
    for name, value, low in (("num_workers", num_workers, 1),
                             ("num_ps", num_ps, 0),
                             ("max_restarts", max_restarts, 0),
                             ("timeout_s", timeout_s, 0),
                             ("cpus_per_task", cpus_per_task or 0, 0)):
      if not value >= low:
        raise LaunchError(f"--{name}={value}: use a number >= {low}")
    self.command = list(command)
    self.num_workers, self.num_ps = num_workers, num_ps
    try:
      check_open_files(num_workers + num_ps + (1 if num_ps else 0))
      self.spec = cluster_spec(num_workers, num_ps)
    except ValueError as e:
      raise LaunchError(str(e)) from None
    self.log_dir = log_dir
    self.timeout_s = timeout_s
    self.quiet = quiet
    self.max_restarts = max_restarts
    self.restarts = 0
    self.verbosity = verbosity
    self.record = record
    self.preload = list(preload)
    self.fork_server: Optional[ForkServer] = None
    self._forks = bool(self.preload) and module_command(command) is not None
    self._lock = threading.Lock()
    self._interrupted = None  # The signal that asked us to stop.
    self._began: Optional[float] = None  # The first start (monotonic).
    # The run ended with a usage error: its command refused its flags.
    self.refused = False
    self.tasks = self._make_tasks()
    self.cpus = self._plan_cpus(cpus_per_task)
    # In a PS cluster the coordinator re-runs a lost worker's steps elsewhere.
    self.tolerated_jobs = {"worker"} if num_ps else set()

  def _plan_cpus(self, cpus_per_task):
    """Each task's cores (None: unpinned); says once why it does not pin
    when `auto` cannot."""
    available = available_cpus()
    if available is None:
      if cpus_per_task:
        raise LaunchError("--cpus_per_task: this system cannot pin a "
                          "process to cores; pass --cpus_per_task=0")
      return None
    try:
      sets = cpu_sets(len(self.tasks), cpus_per_task, available)
    except ValueError as e:
      raise LaunchError(str(e)) from None
    if sets is None and cpus_per_task is None:
      self._say(f"{len(self.tasks)} tasks on {len(available)} cores: the "
                "tasks share them (pinning needs a core per task)")
    return None if sets is None else dict(zip(self.tasks, sets))

  def _make_tasks(self) -> Dict[str, Task]:
    tasks = {}
    for job, addresses in self.spec.items():
      for i in range(len(addresses)):
        trains = job == "chief" or (job == "worker" and not self.num_ps)
        tasks[f"{job}:{i}"] = Task(job, i, trains)
    return tasks

  def start(self) -> None:
    """Starts every task.

    Raises:
      LaunchError: the log directory cannot be made, or the command cannot
        be run; no task is left running.
    """
    try:
      os.makedirs(self.log_dir, exist_ok=True)
    except OSError as e:
      raise LaunchError(
          f"cannot create the log directory {self.log_dir} ({e.strerror}); "
          "pass a --workdir (or --log_dir) that is a directory or can be "
          "created") from None
    header = (f"[launch] restart {self.restarts} of {self.max_restarts}"
              if self.restarts else "")
    if self._began is None:  # --timeout_s counts the fork server's start.
      self._began = time.monotonic()
    server = self._fork_server()
    if self._interrupted:  # While the fork server imported: start nothing.
      return
    started_at = time.time()
    for name, task in self.tasks.items():
      tf_config = json.dumps({"cluster": self.spec,
                              "task": {"type": task.job, "index": task.index}})
      log_path = os.path.join(self.log_dir,
                              f"{task.job}-{task.index}.log")
      cpus = self.cpus and self.cpus[name]
      try:
        task.start(self.command, self._env(tf_config), log_path, self._lock,
                   self.quiet, header, cpus, server)
      except ForkServerError as e:
        self._say(f"the fork server cannot start {task.name} ({e}); "
                  "starting the tasks as new processes", level=-1)
        self._forks = False
        self._close_fork_server()  # The tasks it forked end with it.
        self._stop_tasks(0)
        self.tasks = self._make_tasks()
        return self.start()
      except OSError as e:
        self.stop()
        raise LaunchError(f"cannot run {self.command[0]!r} ({e.strerror}); "
                          "check the command after --") from None
      on = f" on cpus {','.join(map(str, cpus))}" if cpus else ""
      self._say(f"started {task.name} (pid {task.process.pid}){on}, log "
                f"{log_path}")
      self._say(f"{task.name}: TF_CONFIG={tf_config}", level=1)
    self._note("start", t=started_at, restart=self.restarts,
               tasks={n: t.process.pid for n, t in self.tasks.items()})

  def _env(self, tf_config: Optional[str] = None) -> Dict[str, str]:
    """A task's environment (without `tf_config`: what every task shares,
    the fork server's)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "TF_CPP_MIN_LOG_LEVEL": console.native_log_level(self.verbosity)}
    if tf_config is not None:
      env["TF_CONFIG"] = tf_config
    return env

  def _fork_server(self) -> Optional[ForkServer]:
    """The fork server to start the tasks from, started if there is none
    (again if it died); None to start them as new processes: the command
    is not this interpreter running a module, `preload` is empty, or a
    fork server failed (said once)."""
    if not self._forks:
      return None
    if self.fork_server is not None and self.fork_server.alive:
      return self.fork_server
    if self.fork_server is not None:
      self._say(f"the fork server ended ({self.fork_server.death()}); "
                "starting a new one", level=-1)
      self._close_fork_server()
    started = time.time()
    server = ForkServer(self.command[0], self._env(), self.preload,
                        os.path.join(self.log_dir, "fork_server.log"),
                        self.verbosity)
    try:
      server.start(min(READY_TIMEOUT_S, self.timeout_s or READY_TIMEOUT_S),
                   cancelled=lambda: bool(self._interrupted))
    except ForkServerError as e:
      if self._interrupted:
        return None
      self._say(f"the fork server did not start ({e}); starting the tasks "
                "as new processes", level=-1)
      self._note("fork_server", t=started, error=str(e))
      self._forks = False
      return None
    self.fork_server = server
    self._note("fork_server", t=started, ready=time.time(),
               pid=server.process.pid, preload=self.preload)
    self._say(f"started the fork server (pid {server.process.pid}): "
              f"{', '.join(self.preload)} imported in "
              f"{time.time() - started:.1f} s; tasks are forked from it")
    return server

  def _close_fork_server(self) -> None:
    if self.fork_server is not None:
      self.fork_server.close()
      self.fork_server = None

  def interrupt(self, sig: int = signal.SIGINT) -> None:
    """Forwards Ctrl-C (SIGINT) or SIGTERM to every training task; `wait`
    stops the servers once those have saved their checkpoint, then returns
    128 + the signal (130, 143).

    Servers (a PS cluster's workers and parameter servers) hold the
    variables the chief saves on Ctrl-C, so they must outlive it.
    """
    self._interrupted = int(sig)
    for task in self.tasks.values():
      if task.trains:
        task.signal(sig)

  def wait(self) -> int:
    """Watches the tasks until training ends or fails for good; returns an
    exit code."""
    began = time.monotonic() if self._began is None else self._began
    deadline = began + self.timeout_s if self.timeout_s else None
    interrupted_at = None
    while True:
      if self._interrupted:
        interrupted_at = interrupted_at or time.monotonic()
        if (all(t.process is None or t.poll() is not None
                for t in self.tasks.values() if t.trains)
            or time.monotonic() - interrupted_at > 3 * STOP_GRACE_S):
          self.stop()
          return self._exit(128 + self._interrupted)
      failed = self._check_failures()
      if failed is not None:
        task, code = failed
        if (self.restarts < self.max_restarts and not self._interrupted
            and code not in FINAL_CODES and not _usage_error(task, code)):
          self._restart(task, code)
          continue
        self._report(task, code)
        self.refused = _usage_error(task, code)
        self.stop()
        self._note("stopped")
        return self._exit(code if code > 0 else 128 - code)  # -N: signal N.
      trainers = [t for t in self.tasks.values() if t.trains]
      if all(t.poll() == 0 for t in trainers):
        self.stop()
        self._say("training finished; all tasks stopped")
        return self._exit(0)
      if deadline is not None and time.monotonic() > deadline:
        self._say(f"timed out after {self.timeout_s:.0f} s; stopping all "
                  "tasks", level=-1)
        self.stop()
        return self._exit(124)
      time.sleep(POLL_S)

  def _exit(self, code: int) -> int:
    self._note("exit", code=code)
    return code

  def _check_failures(self):
    """The task that failed first of those that failed since the last look,
    as (task, exit code), or None. A tolerated failure is reported here.

    First by the time each exited (`Task.exited_at`), not by name: when
    worker:1 is killed, worker:0 fails a moment later for want of its peer,
    and both may have ended by the next look.
    """
    failed = []
    for task in self.tasks.values():
      code = task.poll()
      if code in (None, 0) or task.stopped or task.reported:
        continue
      task.reported = True
      if self._interrupted:
        continue
      if task.job in self.tolerated_jobs:
        self._note_failure(task, code, tolerated=True)
        self._report(task, code)
        self._say(f"{task.name} failed; the coordinator moves its work to "
                  "the other workers, training goes on", level=-1)
        continue
      failed.append((task, code))
    if not failed:
      return None
    first = min(failed, key=lambda f: f[0].exit_time())
    for task, _ in failed:
      if task is not first[0]:
        task.stopped = True  # It ended because `first` did.
    self._note_failure(*first)
    return first

  def _note_failure(self, task: Task, code: int, tolerated=False) -> None:
    self._note("failed", t=task.exit_wall_time(), task=task.name, code=code,
               detected=time.time(), tolerated=tolerated)

  def _restart(self, task: Task, code: int) -> None:
    """Stops every task and starts the cluster again, on the same ports
    once they are free (new ones if they stay taken)."""
    self.restarts += 1
    self._say(f"{task.name} failed ({_how(code, task)}); restart "
              f"{self.restarts} of {self.max_restarts}: stopping every task "
              f"and restarting the cluster (log {task.log_path})", level=-1)
    self._stop_tasks(RESTART_GRACE_S)
    self._note("stopped")
    ports_free = wait_for_ports(self.spec, PORT_WAIT_S)
    self._note("waited", ports_free=ports_free)
    if not ports_free:
      self.spec = cluster_spec(self.num_workers, self.num_ps)
      self._say(f"the cluster's ports stayed taken for {PORT_WAIT_S:.0f} s; "
                "restarting on new ports", level=-1)
    self.tasks = self._make_tasks()
    self.start()

  def _report(self, task: Task, code: int) -> None:
    lines = "\n".join(f"  | {line}" for line in task.tail())
    self._say(f"{task.name} failed ({_how(code, task)}); last lines of "
              f"{task.log_path}:\n{lines}", level=-1)

  def stop(self, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every running task, then SIGKILL after `grace_s`; then
    the fork server ends."""
    self._stop_tasks(grace_s)
    self._close_fork_server()

  def _stop_tasks(self, grace_s: float) -> None:
    started = [t for t in self.tasks.values() if t.process is not None]
    for task in started:
      if task.poll() is None:
        task.stopped = True
        task.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for task in started:
      try:
        task.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
      except subprocess.TimeoutExpired:
        task.signal(signal.SIGKILL)
        task.process.wait(timeout=STOP_GRACE_S)
    for task in started:
      task.tail()  # Let the log pumps drain.

  def _note(self, event: str, t: Optional[float] = None, **fields) -> None:
    """Appends an event to the record (at `t`, default now); a failed write
    is one warning and the end of the record, not of the launcher."""
    if not self.record:
      return
    try:
      files.append_json_line(self.record, {
          "event": event, "t": time.time() if t is None else t, **fields})
    except OSError as e:
      self._say(f"cannot append to {self.record} ({e.strerror or e}); the "
                "restarts are no longer recorded", level=-1)
      self.record = None

  def _say(self, message: str, level: int = 0) -> None:
    """A launcher line, shown from `--verbosity=level` on (failures and
    restarts, at -1, from -1 on)."""
    if self.verbosity >= level:
      with self._lock:
        print(f"[launch] {message}", flush=True)


def _usage_error(task: Task, code: int) -> bool:
  """Whether the task ended with a usage error, which a restart repeats."""
  return code == USAGE_CODE or (
      code == 1 and any(line.startswith(ABSL_USAGE_LINE)
                        for line in task.tail()))


def _how(code: int, task: Optional[Task] = None) -> str:
  how = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
  if task is not None and getattr(task.process, "server_died", False):
    how += ": the fork server died"
  return how
