r"""The fork server: one process that imports TensorFlow once, from which
`tools.launch` forks its tasks, so that no task (the first, nor any restart
of the cluster) imports it again.

A task's command is forked when it is this Python interpreter running a
module, `PYTHON -m MODULE ARGS...` (`module_command`: the same file, in the
same directory, so the same virtualenv); any other command, and every
command under `--preload=none`, starts as a new process.

**How a task starts.** The launcher starts the server, `PYTHON -m
tools.fork_server`, in its own directory and with the environment its
tasks share, over a Unix socket pair. The server imports the modules of
`--preload` (TensorFlow as the entry points import it: `console.start` at
the launcher's `--verbosity`, with matplotlib deferred), freezes what it
holds out of the collector's reach (`gc.freeze`: the tasks' collector
never walks it, and their pages of it stay shared), and says it is ready.
For each task the launcher sends the module, its arguments, what its
environment changes, its cores, and the write end of the pipe its output
goes to; the server forks. The child becomes the task as
`subprocess.Popen` would have made it: a session of its own, killed when
its parent dies (PR_SET_PDEATHSIG), pinned to its cores, its stdout and
stderr the pipe; it takes the task's environment and arguments, reseeds
numpy's global generator (Python's `random` reseeds itself at a fork), and
runs the module as `__main__` (`runpy`, as `python -m` does): the entry
point runs fresh in every task, so its flags are defined once. It ends as
a `python -m` process ends: atexit handlers and non-daemon threads, the
code of a SystemExit, 1 after a traceback. The server reaps each child and
tells the launcher its exit status and time; `ForkedProcess` is the
launcher's handle, with what the supervisor uses of a `subprocess.Popen`
(`pid`, `stdout`, `poll`, `wait`).

**Why a fork after the import is sound.** `import tensorflow` starts none
of TensorFlow's runtime: no eager context, no devices, no thread pools, no
gRPC; they start at a task's first op or strategy, after the fork. The
server's one other thread is OpenBLAS's pool (numpy's: a thread per further
core), which OpenBLAS's own at-fork handler stops before every fork; the
child starts its pool again at its first BLAS call. So every fork is of a
process with one thread. What TensorFlow reads when its runtime starts is
the task's own: TF_CONFIG, the cores it is pinned to (its thread pools are
sized to them), CUDA_VISIBLE_DEVICES. What it read at its import is the
server's: TF_CPP_MIN_LOG_LEVEL, which the launcher gives every task alike
and so gives the server too (an entry point that sets its own, as
`experiments.train` does from `--verbosity`, gets it through
`console.start`, which changes the level of a TensorFlow imported before);
and OpenBLAS's pool size (the server's cores: a task pinned to fewer may
run as many BLAS threads on them, for numpy's matrix products only).

**Why not multiprocessing's forkserver:** its children end with `os._exit`
after their target (no atexit handlers), write to the server's stdout
rather than a pipe per task, run as multiprocessing children (stdin
replaced, their own SIGINT handling), and report their exit only to their
`Process` object; the server here is a few functions that keep each task a
`python -m` process.

**Goodput.** A forked task's process starts at its fork, so its `import`
phase (`dist_loop/runtime/goodput.py`, from the process's start in /proc
to `train.run`) is the fork to `train.run`. The server's own import comes
once, before the first attempt, and is in no attempt's phases; the
launcher's record has it (`fork_server`, `launch_record.py`).

**Failures.** A server that cannot start (a module of `--preload` that does
not import, no answer within READY_TIMEOUT_S) raises `ForkServerError`;
the launcher says so in one line and starts its tasks as new processes. A
server that dies takes its tasks with it (their PR_SET_PDEATHSIG): each is
reported killed by SIGKILL as the server died (`server_died`), and a
restart starts a new server. The server ends when the launcher closes its
socket or dies (its own PR_SET_PDEATHSIG), its tasks with it. Every wait
here is bounded. This file imports TensorFlow only in the server.
"""

import argparse
import gc
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tools.local_cluster import die_with_parent

READY_TIMEOUT_S = 180.0  # The server's imports, on a loaded machine.
FORK_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 10.0
REAP_S = 1.0  # The server's longest sleep; SIGCHLD wakes it at once.
POLL_S = 0.2
_MAX_MESSAGE = 1 << 16


class ForkServerError(Exception):
  """The fork server cannot start a task; the message says why."""


def module_command(command: Sequence[str]
                   ) -> Optional[Tuple[str, List[str]]]:
  """(module, arguments) if `command` is this interpreter running a module
  (`PYTHON -m MODULE ARGS...`), else None."""
  if len(command) < 3 or command[1] != "-m" or command[2].startswith("-"):
    return None
  program = command[0] if os.sep in command[0] else shutil.which(command[0])
  if program is None or not _same_python(program, sys.executable):
    return None
  return command[2], list(command[3:])


def _same_python(a: str, b: str) -> bool:
  """The same interpreter file, started from the same directory (a
  virtualenv's `bin/python` is a link to the base interpreter)."""
  a, b = os.path.abspath(a), os.path.abspath(b)
  return (os.path.realpath(a) == os.path.realpath(b)
          and os.path.realpath(os.path.dirname(a))
          == os.path.realpath(os.path.dirname(b)))


# -- the launcher's end --


class ForkedProcess:
  """A task the server forked: what the supervisor uses of a
  `subprocess.Popen`, and when it exited (`wait_exit`)."""

  def __init__(self, args: Sequence[str], stdout):
    self.args = list(args)
    self.stdout = stdout
    self.pid: Optional[int] = None
    self.returncode: Optional[int] = None
    self.error: Optional[str] = None  # Why the server could not fork it.
    self.server_died = False  # It ended because the server did.
    self._times: Tuple[float, float] = (0.0, 0.0)
    self._answered = threading.Event()
    self._exited = threading.Event()

  def poll(self) -> Optional[int]:
    return self.returncode

  def wait(self, timeout: Optional[float] = None) -> int:
    if not self._exited.wait(timeout):
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def wait_exit(self) -> Tuple[float, float]:
    """Blocks until the task has exited; when, as (monotonic, wall)."""
    self._exited.wait()
    return self._times

  def _ended(self, code: int, monotonic: float, wall: float) -> None:
    self._times = (monotonic, wall)
    self.returncode = code
    self._exited.set()


class ForkServer:
  """The launcher's end of a fork server.

  Args:
    python: the interpreter (the tasks' command's own).
    env: the environment every task shares; the server runs in it.
    preload: the modules the server imports ("tensorflow" as the entry
      points import it).
    log_path: where the server's own output goes (its import's).
    verbosity: the launcher's `--verbosity`, for TensorFlow's import.
  """

  def __init__(self, python: str, env: Dict[str, str],
               preload: Sequence[str], log_path: str, verbosity: int = 0):
    self.python, self.env = python, dict(env)
    self.preload, self.log_path = list(preload), log_path
    self.verbosity = verbosity
    self.process: Optional[subprocess.Popen] = None
    self._sock: Optional[socket.socket] = None
    self._lock = threading.Lock()
    self._ready = threading.Event()
    self._dead = False
    self._next_id = 0
    self._pending: Dict[int, ForkedProcess] = {}
    self._tasks: Dict[int, ForkedProcess] = {}  # By pid, until they exit.
    self._listener: Optional[threading.Thread] = None

  @property
  def alive(self) -> bool:
    return self.process is not None and not self._dead

  def start(self, timeout_s: float = READY_TIMEOUT_S,
            cancelled: Callable[[], bool] = lambda: False) -> None:
    """Starts the server and waits until it has imported its modules, or
    `timeout_s`, or `cancelled()` (asked every POLL_S).

    Raises:
      ForkServerError: it could not start, was not ready in time, or the
        wait was cancelled; it is not left running.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
      with open(self.log_path, "a", encoding="utf-8") as log:
        self.process = subprocess.Popen(
            [self.python, "-m", "tools.fork_server", f"--fd={theirs.fileno()}",
             f"--preload={','.join(self.preload)}",
             f"--verbosity={self.verbosity}"],
            env=self.env, pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent)
    except OSError as e:
      ours.close()
      raise ForkServerError(f"cannot run {self.python!r} ({e.strerror or e})"
                            ) from None
    finally:
      theirs.close()
    self._sock = ours
    self._listener = threading.Thread(target=self._listen, daemon=True,
                                      name="fork-server")
    self._listener.start()
    deadline = time.monotonic() + timeout_s
    while not (self._ready.wait(POLL_S) or cancelled()
               or time.monotonic() > deadline):
      pass
    if not self._ready.is_set() or self._dead:
      reason = (self.death() if self._dead else "interrupted" if cancelled()
                else f"not ready after {timeout_s:.0f} s; log "
                f"{self.log_path}")
      self.close()
      raise ForkServerError(reason)

  def fork(self, command: Sequence[str], env: Dict[str, str],
           cpus: Optional[Sequence[int]] = None) -> ForkedProcess:
    """Forks a task running `command` (a `module_command`) in `env` on
    `cpus` (None: unpinned); its output is the returned process's `stdout`.

    Raises:
      ForkServerError: the server is gone, does not answer, or cannot fork.
    """
    module, args = module_command(command)
    if not self.alive:
      raise ForkServerError(self.death())
    read_end, write_end = os.pipe()
    process = ForkedProcess(command, open(read_end, encoding=None))  # pylint: disable=consider-using-with
    # What the task's environment changes of the server's: the server's
    # imports may have set variables, as they would in a new process.
    request = {"module": module, "argv": args,
               "set": {k: v for k, v in env.items()
                       if self.env.get(k) != v},
               "unset": [k for k in self.env if k not in env],
               "cpus": None if cpus is None else list(cpus)}
    with self._lock:
      request["id"] = self._next_id
      self._next_id += 1
      self._pending[request["id"]] = process
    try:
      socket.send_fds(self._sock, [json.dumps(request).encode()], [write_end])
      answered = process._answered.wait(FORK_TIMEOUT_S)  # pylint: disable=protected-access
      reason = (f"no answer within {FORK_TIMEOUT_S:.0f} s" if not answered
                else process.error or (None if process.pid else
                                       self.death()))
    except OSError as e:
      reason = f"cannot reach it ({e.strerror or e})"
    finally:
      os.close(write_end)
    if reason is not None:
      with self._lock:
        self._pending.pop(request["id"], None)
      process.stdout.close()
      raise ForkServerError(reason)
    return process

  def close(self) -> None:
    """Ends the server (and any task it still runs); bounded. A server
    that is not serving yet (still importing) is killed."""
    serving = self._ready.is_set() and not self._dead
    if self._sock is not None:
      try:
        self._sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      self._sock.close()
    if self.process is not None:
      if not serving:
        self.process.kill()
      try:
        self.process.wait(timeout=CLOSE_TIMEOUT_S)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait(timeout=CLOSE_TIMEOUT_S)
    if self._listener is not None:
      self._listener.join(timeout=CLOSE_TIMEOUT_S)

  def _listen(self) -> None:
    """The server's messages: ready, forked (or not), a task's exit; at
    the end of the socket, the server is gone, and so are its tasks."""
    while True:
      try:
        data = self._sock.recv(_MAX_MESSAGE)
      except OSError:
        data = b""
      if not data:
        break
      message = json.loads(data)
      with self._lock:
        if "ready" in message:
          self._ready.set()
        elif "forked" in message:
          process = self._pending.pop(message["forked"], None)
          if process is None:  # Too late: `fork` gave up, and the server
            continue  # is closed, with the task.
          process.pid = message.get("pid")
          process.error = message.get("error")
          if process.pid is not None:
            self._tasks[process.pid] = process
          process._answered.set()  # pylint: disable=protected-access
        elif "exited" in message:
          process = self._tasks.pop(message["exited"], None)
          if process is not None:
            process._ended(message["code"], message["monotonic"],  # pylint: disable=protected-access
                           message["t"])
    with self._lock:
      self._dead = True
      self._ready.set()
      for process in self._pending.values():
        process._answered.set()  # pylint: disable=protected-access
      # Killed by the kernel as the server went (PR_SET_PDEATHSIG).
      for process in self._tasks.values():
        process.server_died = True
        process._ended(-signal.SIGKILL, time.monotonic(), time.time())  # pylint: disable=protected-access
      self._pending.clear()
      self._tasks.clear()

  def death(self) -> str:
    """Why the server is gone: its exit code and its log's last line."""
    if self.process is None:
      return "it was not started"
    try:
      code = self.process.wait(timeout=CLOSE_TIMEOUT_S)
      how = (f"exit code {code}" if code >= 0 else
             f"killed by signal {-code}")
    except subprocess.TimeoutExpired:
      how = "its socket closed"
    try:
      with open(self.log_path, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    except OSError:
      lines = []
    last = f": {lines[-1]}" if lines else ""
    return f"{how}{last}; log {self.log_path}"


# -- the server's end --


def serve(sock: socket.socket, preload: Sequence[str], verbosity: int):
  """Imports `preload`, then forks a task per request until the launcher
  closes its end. Returns None in the server at the end, and
  (request, output fd, the server's pid) in each child, which then
  becomes the task (`become_task`)."""
  _import(preload, verbosity)
  gc.collect()
  gc.freeze()  # Nothing imported is walked again, or copied by a walk.
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_r, False)
  os.set_blocking(wake_w, False)
  signal.set_wakeup_fd(wake_w)
  signal.signal(signal.SIGCHLD, lambda *_: None)  # Wakes the select.
  server_pid = os.getpid()
  if not _send(sock, ready=server_pid):
    return None
  while True:
    readable, _, _ = select.select([sock, wake_r], [], [], REAP_S)
    if wake_r in readable:
      while _read_all(wake_r):
        pass
    if sock in readable:
      try:
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
      except OSError:
        data, fds = b"", []
      if not data:
        return None  # The launcher closed its end, or died.
      request = json.loads(data)
      try:
        pid = os.fork()
      except OSError as e:
        pid = None
        error = f"cannot fork ({e.strerror or e})"
      if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (wake_r, wake_w):
          os.close(fd)
        sock.close()
        return request, fds[0], server_pid
      for fd in fds:
        os.close(fd)
      if not (_send(sock, forked=request["id"], pid=pid) if pid else
              _send(sock, forked=request["id"], error=error)):
        return None
    if not _reap(sock):
      return None


def _import(preload: Sequence[str], verbosity: int) -> None:
  """Imports `preload`, TensorFlow first (before another module imports
  it less carefully)."""
  for name in sorted(preload, key=lambda name: name != "tensorflow"):
    if name == "tensorflow":  # As the entry points import it.
      from dist_loop.runtime import console  # pylint: disable=g-import-not-at-top
      from experiments import startup  # pylint: disable=g-import-not-at-top
      with startup.matplotlib_deferred():
        console.start(verbosity)
    else:
      importlib.import_module(name)


def _read_all(fd: int) -> bool:
  try:
    return bool(os.read(fd, 4096))
  except BlockingIOError:
    return False


def _reap(sock: socket.socket) -> bool:
  """Reaps every child that has exited and tells the launcher; False if
  the launcher is gone."""
  while True:
    try:
      pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return True
    if pid == 0:
      return True
    if not _send(sock, exited=pid, code=os.waitstatus_to_exitcode(status),
                 monotonic=time.monotonic(), t=time.time()):
      return False


def _send(sock: socket.socket, **message) -> bool:
  try:
    sock.send(json.dumps(message).encode())
    return True
  except OSError:
    return False


def become_task(request: Dict[str, object], output: int,
                server_pid: int) -> None:
  """In a forked child: becomes the task `request` asks for and runs its
  module as `__main__`; returns when the module does."""
  os.setsid()  # Signals reach it only through the launcher.
  die_with_parent()
  if os.getppid() != server_pid:  # The server died before the line above.
    os.kill(os.getpid(), signal.SIGKILL)
  os.dup2(output, 1)
  os.dup2(output, 2)
  os.close(output)
  if request["cpus"] is not None:
    os.sched_setaffinity(0, request["cpus"])
  for name in request["unset"]:
    os.environ.pop(name, None)
  os.environ.update(request["set"])
  if "numpy" in sys.modules:  # A fresh process seeds it from the OS.
    sys.modules["numpy"].random.seed()
  sys.argv = [str(request["module"]), *request["argv"]]
  runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tools.fork_server")
  parser.add_argument("--fd", type=int, required=True)
  parser.add_argument("--preload", default="tensorflow")
  parser.add_argument("--verbosity", type=int, default=0)
  args = parser.parse_args(argv)
  served = serve(socket.socket(fileno=args.fd),
                 [m for m in args.preload.split(",") if m], args.verbosity)
  if served is None:
    return 0
  become_task(*served)
  return 0


if __name__ == "__main__":
  sys.exit(main())
