"""The parts of a local cluster that `tools/launch.py` starts: its
addresses (free localhost ports, the TF_CONFIG cluster spec, waiting for the
ports of a stopped cluster to free), its cores (`cpu_sets`) and its
processes (`Task`). This file does not import TensorFlow."""

import collections
import ctypes
import errno
import os
import random
import resource
import signal
import socket
import subprocess
import threading
import time
from typing import Dict, List, Optional, Sequence

TAIL_LINES = 25
_PR_SET_PDEATHSIG = 1

# What the launcher holds open per running task (its output pipe and its
# log), and for itself (its imports, the record, the fork server's socket).
FILES_PER_TASK = 2
OWN_FILES = 64

_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PORT = 20000  # Below it, well-known services are more common.


def _ephemeral_ports() -> Optional[range]:
  """The kernel's range for outgoing connections' local ports, if known."""
  try:
    with open(_EPHEMERAL_RANGE_FILE, encoding="ascii") as f:
      low, high = (int(x) for x in f.read().split())
    return range(low, high + 1)
  except (OSError, ValueError):
    return None


def free_ports(n: int) -> List[int]:
  """n distinct localhost ports that are free now and stay likely free.

  Ports are held open together, then released, and each task binds its
  own a few seconds later (after importing TensorFlow). A port the kernel
  picks (bind to 0) is an ephemeral one: in that gap, any outgoing
  connection, such as the cluster's own gRPC channels, can be given it.
  So the ports are drawn at random outside the ephemeral range (below it,
  or above it), where the kernel never puts an outgoing connection. Only
  if no such port is free, or the range is unknown (not Linux), does the
  kernel pick.

  Raises:
    ValueError: n ports cannot be held open together (too few free ports,
      or more than the open-file limit); the message names the fix.
  """
  ephemeral = _ephemeral_ports()
  candidates: List[int] = []
  if ephemeral is not None:  # Below the range, or above it (1024-65535?).
    candidates = [*range(_LOWEST_PORT, max(ephemeral.start, _LOWEST_PORT)),
                  *range(max(ephemeral.stop, _LOWEST_PORT), 65536)]
    random.SystemRandom().shuffle(candidates)
  sockets, ports = [], []
  try:
    for port in candidates:
      if len(ports) == n:
        break
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      try:
        s.bind(("", port))  # All interfaces, as the TensorFlow server binds.
      except OSError:
        s.close()
        continue
      sockets.append(s)
      ports.append(port)
    while len(ports) < n:
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      sockets.append(s)
      s.bind(("localhost", 0))
      ports.append(s.getsockname()[1])
    return ports
  except OSError as e:
    fix = (" or raise the open-file limit (ulimit -n)"
           if e.errno == errno.EMFILE else "")
    raise ValueError(f"cannot reserve {n} free localhost ports "
                     f"({e.strerror} after {len(ports)}); use fewer "
                     f"tasks{fix}") from None
  finally:
    for s in sockets:
      s.close()


def check_open_files(num_tasks: int) -> None:
  """Raises ValueError if `num_tasks` tasks need more open files than this
  process may have (RLIMIT_NOFILE)."""
  limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
  needed = num_tasks * FILES_PER_TASK + OWN_FILES
  if limit != resource.RLIM_INFINITY and needed > limit:
    raise ValueError(f"{num_tasks} tasks need about {needed} open files, "
                     f"and this process may open {limit}; use fewer tasks, "
                     "or raise the limit (ulimit -n)")


def cluster_spec(num_workers: int, num_ps: int,
                 ports: Optional[Sequence[int]] = None) -> Dict[str, List[str]]:
  """The localhost cluster: workers only, or chief + workers + ps."""
  jobs = ([("worker", num_workers)] if num_ps == 0
          else [("chief", 1), ("worker", num_workers), ("ps", num_ps)])
  total = sum(n for _, n in jobs)
  ports = list(ports) if ports is not None else free_ports(total)
  spec = {}
  for job, n in jobs:
    spec[job] = [f"localhost:{ports.pop(0)}" for _ in range(n)]
  return spec


def ports_free(spec: Dict[str, List[str]]) -> bool:
  """Whether every port of `spec` can be bound again now. With
  SO_REUSEADDR, as gRPC binds: connections of a stopped server that linger
  in TIME_WAIT do not hold its port."""
  for address in (a for addresses in spec.values() for a in addresses):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        s.bind(("", int(address.rsplit(":", 1)[1])))
      except OSError:
        return False
  return True


def wait_for_ports(spec: Dict[str, List[str]], timeout_s: float) -> bool:
  """Waits up to `timeout_s` for `ports_free(spec)`; returns whether."""
  deadline = time.monotonic() + timeout_s
  while not ports_free(spec):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.1)
  return True


# -- the cores --


def available_cpus() -> Optional[List[int]]:
  """The cores this process may run on, or None where Linux's affinity
  calls do not exist."""
  if not hasattr(os, "sched_getaffinity"):
    return None
  return sorted(os.sched_getaffinity(0))


def cpu_sets(num_tasks: int, cpus_per_task: Optional[int],
             available: Sequence[int]) -> Optional[List[List[int]]]:
  """Disjoint cores for each task, or None to leave every task unpinned.

  Args:
    num_tasks: the tasks of the cluster, each a process.
    cpus_per_task: cores per task; None ("auto") gives each task an equal
      share of `available` if there is at least one core per task, else
      pins nothing; 0 pins nothing.
    available: the cores the tasks may use, in order.

  Returns:
    Task i's cores, consecutive in `available`; None for unpinned.

  Raises:
    ValueError: `cpus_per_task` cores for every task are more than
      `available` has.
  """
  if cpus_per_task is None:
    cpus_per_task = len(available) // num_tasks
  if cpus_per_task == 0:
    return None
  if cpus_per_task * num_tasks > len(available):
    raise ValueError(
        f"--cpus_per_task={cpus_per_task} for {num_tasks} tasks needs "
        f"{cpus_per_task * num_tasks} cores, and this process may use "
        f"{len(available)}; lower it, or pass --cpus_per_task=0 to leave "
        "the tasks unpinned")
  return [list(available[i * cpus_per_task:(i + 1) * cpus_per_task])
          for i in range(num_tasks)]


# -- the processes --


def die_with_parent():
  """Runs in a child: the kernel kills it if its parent (the launcher, or
  the fork server) dies (Linux)."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):
    pass


def _in_child(cpus: Optional[Sequence[int]]):
  """What runs in the child before the command: it dies with the launcher,
  and runs on `cpus` (None: wherever the launcher may)."""

  def prepare():
    die_with_parent()
    if cpus is not None:
      os.sched_setaffinity(0, cpus)

  return prepare


class Task:
  """One process of the cluster, its log file and its console prefix."""

  def __init__(self, job: str, index: int, trains: bool):
    self.job, self.index, self.trains = job, index, trains
    self.name = f"{job}:{index}"
    self.process: Optional[subprocess.Popen] = None
    self.cpus: Optional[List[int]] = None  # None: unpinned.
    self.log_path = ""
    self.stopped = False  # We stopped it: its exit code is not a failure.
    self.reported = False
    self._tail = collections.deque(maxlen=TAIL_LINES)
    self._reader: Optional[threading.Thread] = None
    self._exited_at: Optional[float] = None
    self._exited_wall: Optional[float] = None

  def start(self, command, env, log_path, console_lock, quiet, header="",
            cpus=None, fork_server=None):
    """Starts the process on `cpus` (None: unpinned), forked by
    `fork_server` if given (`tools/fork_server.py`), else as a new process;
    its output goes to `log_path` (appended, after `header` if any) and,
    unless `quiet`, to the console.

    Raises:
      OSError: the command cannot be run.
      ForkServerError: the fork server cannot fork it.
    """
    self.log_path, self.cpus = log_path, cpus
    if header:
      with open(log_path, "a", encoding="utf-8") as log:
        log.write(header + "\n")
    if fork_server is not None:
      self.process = fork_server.fork(command, env, cpus)
    else:
      self.process = subprocess.Popen(
          command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
          stdin=subprocess.DEVNULL, text=True, bufsize=1,
          start_new_session=True,  # Signals reach it only through us.
          preexec_fn=_in_child(cpus))
    self._reader = threading.Thread(
        target=self._pump, args=(console_lock, quiet), daemon=True,
        name=f"log-{self.name}")
    self._reader.start()
    self._exited_at = self._exited_wall = None
    threading.Thread(target=self._watch_exit, daemon=True,
                     name=f"exit-{self.name}").start()

  def _watch_exit(self):
    """Notes when the process ends, without reaping it (`poll` does); a
    forked one's end is the fork server's to note."""
    if not isinstance(self.process, subprocess.Popen):
      self._exited_at, self._exited_wall = self.process.wait_exit()
      return
    try:
      os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # Already reaped: it has ended.
      pass
    self._exited_at = time.monotonic()
    self._exited_wall = time.time()

  def exit_time(self) -> float:
    """When the process ended (monotonic clock); now if not noted yet."""
    return self._exited_at if self._exited_at is not None else (
        time.monotonic())

  def exit_wall_time(self) -> float:
    """When the process ended, as a wall time; now if not noted yet."""
    return self._exited_wall if self._exited_wall is not None else (
        time.time())

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
    if self.process is not None and self.process.poll() is None:
      try:
        os.killpg(self.process.pid, sig)
      except ProcessLookupError:
        pass

  def tail(self) -> List[str]:
    if self._reader is not None:
      self._reader.join(timeout=2.0)  # The pipe closes when the task exits.
    return list(self._tail)
