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
the command, its flagfiles expanded; `--log_dir` overrides) and, prefixed
with `[task]`, to the console. Beside the logs, WORKDIR/logs/launch.jsonl
records what the launcher did, one JSON line per event (the cluster's
start, a task's failure with its exit code and time, the others stopped,
the wait for the ports, the start again, the exit;
`dist_loop/runtime/launch_record.py`): goodput (`tools.goodput`,
summary.json) splits the downtime of each restart by it. Ctrl-C and
SIGTERM are forwarded to every training task (in a PS cluster, the servers
are stopped once the chief has saved), and the launcher then exits 130 or
143. The launcher exits 0 once every
training process exited 0 (then it stops the servers). If a task fails, it
stops the others, prints the tail of the log of the task that failed first
(by the time each ended: a peer's failure follows) and exits with that
task's code; a failed worker of a parameter-server cluster is the one
exception: the coordinator moves its work to the other workers, so it is
reported and training goes on.

`--max_restarts=N` (as torchrun's): after a failure, stop every task, wait
for the cluster's ports to free, and start the whole cluster again with the
same command (and the same TF_CONFIG, unless a port was taken meanwhile);
every task resumes from the last checkpoint. One line per restart says why,
and which of N it is; the (N+1)-th failure ends the launcher with that
task's exit code. Exit code 3 (the run diverged) is never restarted: a
restart would diverge the same way; nor is a usage error (exit code 2, or
absl's exit 1 with "FATAL Flags parsing error"), which every restart would
repeat. A lost parameter server, or a worker's SIGTERM exit, is a
failure like any other. On real hosts, run the train command itself with a
hand-written TF_CONFIG per host, or under SLURM with srun (README, "Multiple
processes and hosts").

Start-up (`--preload`): when the command is this Python interpreter running
a module (`python -m experiments.train ...`, as above), a fork server
imports TensorFlow once (`--preload=tensorflow`, the default; a
comma-separated list of modules) and every task is forked from it, at the
start and at every restart, so that no task imports TensorFlow itself. A
forked task is what a new process would be (its TF_CONFIG, environment,
cores, log, session, signals and exit code), running the module as
`__main__`; its goodput `import` phase starts at its fork. The server's own
output goes to LOG_DIR/fork_server.log, and its start to the record. A
fork server that cannot start is one line, and the tasks start as new
processes; `--preload=none` starts them so always, as any other command.
`tools/fork_server.py` says how, and why a fork after TensorFlow's import
is sound.

`--num_data_workers=N` also starts a tf.data service of N workers on this
host (`tools.data_service`, stopped with the cluster, and killed with the
launcher as a task is) and appends
`--data_service=grpc://localhost:PORT` to the command (docs/data.md).

Cores (`--cpus_per_task`): local tasks that share every core fight over
them (each TensorFlow process sizes its thread pools to the cores it may
use). `auto`, the default, gives each task its own equal share of the cores
the launcher may use when there is at least one per task, and else leaves
them unpinned and says so once; `N` pins N cores per task (an error if there
are not that many); `0` never pins. Pinning is `sched_setaffinity` in the
child before the command starts, so TensorFlow sizes its pools to the share.

The terminal: the launcher's `[launch]` lines and its tasks' lines. Each
task runs with the native log level of `--verbosity` (0: TensorFlow's
native errors hidden, as `experiments.train` hides them; the train command
itself follows its own `--verbosity`); from `--verbosity=1` the launcher
also prints each task's TF_CONFIG. Bad input (a workdir that is a file or
empty, or whose lock a live run holds; a command that does not exist, a bad
flag) is one `error:` line and exit 2, and writes nothing. A command that
refuses its flags (a usage error, below) before writing anything leaves no
directory the launcher made for its logs. A task command must exec its
trainer: the kernel kills only a task's first process with the launcher
(docs/clusters.md).
This file does not import TensorFlow.
"""

import argparse
import fcntl
import os
import shutil
import signal
import stat
import subprocess
import sys
from typing import List, Optional, Sequence

# Re-exported: tests build clusters and reserve ports the way the launcher
# does, and drive a Launcher.
from dist_loop.runtime import launch_record, lock
from experiments import flagfiles
from tools.local_cluster import (cluster_spec, die_with_parent,  # noqa: F401
                                 free_ports)
from tools.supervisor import Launcher, LaunchError

EXIT_BAD_INPUT = 2


def workdir_of(command: Sequence[str]) -> Optional[str]:
  """The value of `--workdir` in a command, if it has one: the last, with
  its flagfiles read as the train command reads them
  (`experiments/flagfiles.py`: nested, never a FIFO or a device), so that
  `--flagfile=WORKDIR/flags.txt` names the workdir.

  Raises:
    LaunchError: a flagfile of the command cannot be read.
  """
  try:
    args = flagfiles.expand_flagfiles(command)
  except flagfiles.FlagfileError as e:
    raise LaunchError(str(e)) from None
  workdir = None
  for i, arg in enumerate(args):
    if arg == "--":  # As absl: no flag after it.
      break
    if arg.startswith("--workdir="):
      workdir = arg.split("=", 1)[1]
    elif arg == "--workdir" and i + 1 < len(args):
      workdir = args[i + 1]
  return workdir


def _check_not_in_use(workdir: str) -> None:
  """Raises LaunchError if a run holds a lock of `workdir`
  (`dist_loop/runtime/lock.py`), before the launcher writes its logs
  there: a refused launch leaves the live run's logs as they were. Only
  probes: creates nothing, opens only regular files, holds nothing."""
  try:
    names = sorted(n for n in os.listdir(workdir) if n == lock.LOCK_FILE
                   or n.startswith(lock.LOCK_FILE + "."))
  except OSError:
    return  # No workdir yet; or the train command says why it cannot.
  for name in names:
    path = os.path.join(workdir, name)
    try:
      if not stat.S_ISREG(os.lstat(path).st_mode):
        continue
      fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
      raise LaunchError(
          f"--workdir={workdir} is in use by another run (pid "
          f"{holder if holder.isdigit() else 'unknown'}, lock {path}); wait "
          "for it to end, stop it, or use another --workdir") from None
    except OSError:
      pass  # A filesystem without flock: the train command says so.
    finally:
      os.close(fd)


def _missing_dirs(path: str) -> List[str]:
  """`path` and those of its parents that do not exist, innermost first."""
  missing = []
  path = os.path.abspath(path)
  while not os.path.lexists(path):
    missing.append(path)
    path = os.path.dirname(path)
  return missing


def _remove_refused_logs(launcher: Launcher) -> None:
  """After a run its command refused (`Launcher.refused`): removes the logs
  and the directories this launch created for them (`created_dirs`,
  innermost first), if they hold nothing else, so that a refused run leaves
  no new directory; says so."""
  created = launcher.created_dirs
  if not created:
    return
  ours = {os.path.abspath(p) for p in (
      launcher.record, os.path.join(launcher.log_dir, "fork_server.log"),
      *(t.log_path for t in launcher.tasks.values())) if p}
  found, dirs = set(), set()
  for root, subdirs, names in os.walk(created[-1]):
    found.update(os.path.join(root, n) for n in names)
    dirs.update(os.path.join(root, d) for d in subdirs)
  if not (found <= ours and dirs <= set(created)):
    return  # The command wrote something: keep it all.
  try:
    for path in found:
      os.remove(path)
    for path in created:
      os.rmdir(path)
  except OSError:
    return
  if launcher.verbosity >= -1:
    print(f"[launch] the command refused its flags before writing anything; "
          f"removed {created[-1]}, which this launch created for its logs",
          flush=True)


USAGE = ("python -m tools.launch --num_workers=N [--num_ps=P] "
         "[--cpus_per_task=auto|N] [--preload=tensorflow|none] "
         "[--verbosity=V] -- COMMAND...")


class _Parser(argparse.ArgumentParser):
  """argparse, its errors one `error:` line."""

  def error(self, message):
    raise LaunchError(f"{message}; usage: {USAGE}")


def _cpus_per_task(text: str) -> Optional[int]:
  if text == "auto":
    return None
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"{text!r} is not auto or a number of cores") from None


def _modules(text: str) -> List[str]:
  """--preload's modules: a comma-separated list, or none."""
  if text in ("none", ""):
    return []
  names = text.split(",")
  for name in names:
    if not all(part.isidentifier() for part in name.split(".")):
      raise argparse.ArgumentTypeError(
          f"{name!r} is not a module name; pass modules separated by "
          "commas, or none")
  return names


def _parse(argv: Sequence[str]) -> Launcher:
  """The launcher that `argv` asks for.

  Raises:
    LaunchError: bad flags, no command, a command that does not exist, or
      a workdir that is a file.
  """
  wants_help = {"-h", "--help"} & set(argv)
  if "--" not in argv and not wants_help:
    raise LaunchError(f"no command; usage: {USAGE}")
  split = argv.index("--") if "--" in argv else len(argv)
  parser = _Parser(prog="python -m tools.launch", usage=USAGE)
  parser.add_argument("--num_workers", type=int, required=True)
  parser.add_argument("--num_ps", type=int, default=0)
  parser.add_argument("--log_dir", default=None,
                      help="default: WORKDIR/logs, WORKDIR from --workdir")
  parser.add_argument("--timeout_s", type=float, default=0,
                      help="stop everything and exit 124 after this many "
                      "seconds (0, the default: no time limit)")
  parser.add_argument("--max_restarts", type=int, default=0,
                      help="after a failure, restart the whole cluster up "
                      "to N times (0: stop at the first failure; exit code 3, "
                      "a diverged run, and a usage error are never "
                      "restarted)")
  parser.add_argument("--cpus_per_task", type=_cpus_per_task, default=None,
                      help="cores per task: auto (a share of the cores if "
                      "there is one per task), N, or 0 (never pin)")
  parser.add_argument("--verbosity", "-v", type=int, default=0,
                      help="-1: failures only; 0: also the tasks' start; "
                      "1: also each task's TF_CONFIG and TensorFlow's "
                      "native warnings")
  parser.add_argument("--num_data_workers", type=int, default=0,
                      help="start a tf.data service of N workers on this "
                      "host and pass --data_service to the command")
  parser.add_argument("--preload", type=_modules, default="tensorflow",
                      help="modules a fork server imports once, to fork "
                      "each task from when the command is `python -m "
                      "MODULE` (default: tensorflow; none: every task "
                      "starts as a new process)")
  args = parser.parse_args(argv[:split])
  command = list(argv[split + 1:])
  if not command:
    raise LaunchError(f"no command after --; usage: {USAGE}")
  if args.num_data_workers < 0:
    raise LaunchError(f"--num_data_workers={args.num_data_workers}: use a "
                      "number >= 0")
  _check_command(command[0])
  workdir = workdir_of(command)
  if workdir == "":
    raise LaunchError("--workdir is empty; name the run's directory, for "
                      "example --workdir=runs/default")
  if workdir is not None:
    if os.path.exists(workdir) and not os.path.isdir(workdir):
      raise LaunchError(f"--workdir={workdir} is a file; pass a directory "
                        "(it is created if missing)")
    _check_not_in_use(workdir)
  log_dir = args.log_dir
  if log_dir is None:
    if workdir is None:
      raise LaunchError("the command has no --workdir; pass --log_dir")
    log_dir = os.path.join(workdir, "logs")
  data_service_port = None
  if args.num_data_workers > 0:
    try:
      data_service_port = free_ports(1)[0]
    except ValueError as e:
      raise LaunchError(str(e)) from None
    command.append(f"--data_service=grpc://localhost:{data_service_port}")
  launcher = Launcher(command, args.num_workers, args.num_ps, log_dir,
                      args.timeout_s, max_restarts=args.max_restarts,
                      cpus_per_task=args.cpus_per_task,
                      verbosity=args.verbosity,
                      record=os.path.join(log_dir, launch_record.FILE_NAME),
                      preload=args.preload)
  launcher.data_service = (
      None if data_service_port is None else
      [sys.executable, "-m", "tools.data_service",
       f"--num_workers={args.num_data_workers}",
       f"--port={data_service_port}",
       f"--timeout_s={args.timeout_s or 24 * 3600.0}"])
  launcher.created_dirs = _missing_dirs(log_dir)
  return launcher


def _check_command(program: str) -> None:
  """Raises LaunchError unless `program` can be run."""
  if os.sep in program:
    runnable = os.path.isfile(program) and os.access(program, os.X_OK)
  else:
    runnable = shutil.which(program) is not None
  if not runnable:
    raise LaunchError(f"command {program!r} not found or not executable; "
                      "check the command after --")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    launcher = _parse(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, lambda number, _: launcher.interrupt(number))
    # As a task: signals reach it only through us, and it dies with us.
    service = (subprocess.Popen(launcher.data_service,
                                stdout=subprocess.DEVNULL,
                                start_new_session=True,
                                preexec_fn=die_with_parent)
               if launcher.data_service else None)
    try:
      launcher.start()
      code = launcher.wait()  # A restart starts the tasks again.
      if launcher.refused:
        _remove_refused_logs(launcher)
      return code
    finally:
      if service is not None:  # Its own SIGTERM handler stops it.
        service.terminate()
        try:
          service.wait(timeout=30)
        except subprocess.TimeoutExpired:
          service.kill()
  except LaunchError as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
  sys.exit(main())
