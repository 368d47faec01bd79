"""The local launcher: per-task TF_CONFIG and logs, failures, restarts,
Ctrl-C; tasks started as new processes and forked by the fork server.

The tasks here are tiny Python programs, not training runs, so these tests
take seconds: the tests of the launcher's rules run each program both as
`python -c SCRIPT` (a new process per task) and as `python -m MODULE`
(forked by a fork server that preloads `json`, which costs nothing), and
one test forks from a fork server that preloads TensorFlow;
tests/test_multiworker.py and tests/test_ps.py launch real training (forked:
their command is `python -m experiments.train`).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_launch, run_tool

from dist_loop.runtime import goodput, launch_record
from tools import fork_server, launch, local_cluster

class Tasks:
  """How a test's task program runs: `python -c SCRIPT`, or (`forked`) the
  script written as a module of `modules` (on PYTHONPATH), `python -m
  MODULE`, which the launcher forks from a fork server preloading json."""

  def __init__(self, forked: bool, modules):
    self.forked, self.modules = forked, modules

  def __call__(self, script):
    """The launcher's arguments from `--` on (with `--preload` before it,
    forked) for a command that runs `script`."""
    if not self.forked:
      return ["--", sys.executable, "-c", script]
    self.modules.mkdir(exist_ok=True)
    name = f"task_{len(list(self.modules.iterdir()))}"
    (self.modules / f"{name}.py").write_text(script)
    return ["--preload=json", "--", sys.executable, "-m", name]

  def check(self, log_dir):
    """The launcher's record says it forked the tasks, if they are."""
    events = launch_record.read(str(log_dir / launch_record.FILE_NAME))
    servers = [e for e in events if e["event"] == "fork_server"]
    assert [("pid" in e, "error" in e) for e in servers] == (
        [(True, False)] if self.forked else []), servers


@pytest.fixture(name="tasks", params=["new process", "forked"])
def _tasks(request, tmp_path, monkeypatch):
  forked = request.param == "forked"
  if forked:
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "modules"))
  return Tasks(forked, tmp_path / "modules")


# Prints its task, then: worker 1 fails with exit code 3 once the others
# have printed theirs (else a slow start could lose their line), the others
# wait.
FAIL_ONE = """
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
print("task", task["type"], task["index"], flush=True)
if task["index"] == 1:
  logs = os.path.join(sys.argv[1].split("=", 1)[1], "logs")
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and not all(
      os.path.exists(p) and "task worker" in open(p).read()
      for p in (os.path.join(logs, f"worker-{i}.log") for i in (0, 2))):
    time.sleep(0.05)
  print("boom: worker 1 gives up", flush=True)
  sys.exit(3)
time.sleep(60)
"""

# Records each of its runs (its cluster spec) in WORKDIR/runs-<job>-<i>; the
# task named by argv[3] fails with exit code 3 in its first argv[2] runs,
# once every other task has recorded the same run (else the launcher could
# stop one before it does); argv[4] is its exit code, or SIGKILL to die by
# that signal. Training tasks then finish; servers (a PS cluster's workers
# and PSs) wait.
FAIL_FIRST_RUNS = """
import json, os, signal, sys, time
config = json.loads(os.environ["TF_CONFIG"])
job, index = config["task"]["type"], config["task"]["index"]
workdir = sys.argv[1].split("=", 1)[1]
os.makedirs(workdir, exist_ok=True)
runs = os.path.join(workdir, f"runs-{job}-{index}")
with open(runs, "a") as f:
  f.write(json.dumps(config["cluster"], sort_keys=True) + "\\n")
with open(runs) as f:
  run = len(f.read().splitlines())

def recorded(path):
  return os.path.exists(path) and len(open(path).read().splitlines()) >= run

if f"{job}:{index}" == sys.argv[3] and run <= int(sys.argv[2]):
  others = [os.path.join(workdir, f"runs-{j}-{i}")
            for j, addresses in config["cluster"].items()
            for i in range(len(addresses))]
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and not all(map(recorded, others)):
    time.sleep(0.05)
  print("boom", flush=True)
  if sys.argv[4] == "SIGKILL":
    os.kill(os.getpid(), signal.SIGKILL)
  sys.exit(int(sys.argv[4]))
if job == "ps" or (job == "worker" and "ps" in config["cluster"]):
  time.sleep(60)
time.sleep(1.0)
"""

# A run's attempts as their goodput record shows them, without TensorFlow:
# the first trains steps 0..10 and dies by SIGKILL LOST_S after its last
# record; the next resumes at 10, trains to 20 and prints its totals (which
# read the launcher's record).
LOST_S = 0.3
ATTEMPTS = f"""
import json, os, signal, sys, time
from dist_loop.runtime import goodput, launch_record
workdir = sys.argv[1].split("=", 1)[1]
os.makedirs(workdir, exist_ok=True)
recorder = goodput.Recorder(os.path.join(workdir, goodput.GOODPUT_FILE),
                            goodput.Clock(),
                            launches=launch_record.path(workdir))
start = 10 if recorder.earlier else 0
recorder.restore(start, 0.0)
recorder.loop(start, start + 10, 0.01)
if not start:
  time.sleep({LOST_S})
  os.kill(os.getpid(), signal.SIGKILL)
recorder.write(final=True)
print("totals", json.dumps(recorder.totals()), flush=True)
"""

# Prints the cores it may run on and its native TensorFlow log level.
SHOW_CORES = """
import json
import os
print("cores", sorted(os.sched_getaffinity(0)), flush=True)
print("native log level", os.environ.get("TF_CPP_MIN_LOG_LEVEL"), flush=True)
"""

# Says when it got SIGINT or SIGTERM, then exits 128 + N like the train
# command does.
TRAP_SIGINT = """
import signal, sys, time
def on_signal(number, _):
  print("got", signal.Signals(number).name, flush=True)
  sys.exit(128 + number)
signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
print("ready", flush=True)
time.sleep(60)
"""


def test_cluster_spec_has_distinct_free_ports():
  spec = launch.cluster_spec(num_workers=2, num_ps=1)
  assert sorted(spec) == ["chief", "ps", "worker"]
  assert (len(spec["chief"]), len(spec["worker"]), len(spec["ps"])) == (1, 2, 1)
  addresses = spec["chief"] + spec["worker"] + spec["ps"]
  assert len(set(addresses)) == 4
  assert launch.cluster_spec(num_workers=3, num_ps=0).keys() == {"worker"}


def test_ports_are_drawn_outside_the_ephemeral_range(tmp_path, monkeypatch):
  # An outgoing connection can be given a port between the launcher's check
  # and the task's bind only if it is in the kernel's ephemeral range.
  ranges = tmp_path / "ip_local_port_range"
  ranges.write_text("40000\t50000\n")
  monkeypatch.setattr(local_cluster, "_EPHEMERAL_RANGE_FILE", str(ranges))
  ports = launch.free_ports(6)
  assert len(set(ports)) == 6
  assert all(local_cluster._LOWEST_PORT <= p < 40000 or p > 50000  # pylint: disable=protected-access
             for p in ports), ports
  # A range that starts low: the ports above it.
  ranges.write_text("1024 60000\n")
  assert all(p > 60000 for p in launch.free_ports(4))
  # Without the file (not Linux), the kernel picks.
  monkeypatch.setattr(local_cluster, "_EPHEMERAL_RANGE_FILE",
                      str(tmp_path / "no"))
  assert len(set(launch.free_ports(3))) == 3


def test_workdir_is_read_from_the_command(tmp_path):
  assert launch.workdir_of(["python", "--workdir=/r/a"]) == "/r/a"
  assert launch.workdir_of(["python", "--workdir", "/r/b"]) == "/r/b"
  assert launch.workdir_of(["python", "--workdir=/r/a", "--workdir=/r/c"]
                           ) == "/r/c"  # As absl: the last wins.
  assert launch.workdir_of(["python", "--", "--workdir=/r/a"]) is None
  # From a flagfile (a resume's WORKDIR/flags.txt), nested ones too.
  (tmp_path / "flags.txt").write_text("# flags\n--workdir=/r/d\n--x=1\n")
  (tmp_path / "outer.flags").write_text("--flagfile=flags.txt\n")
  for flagfile in ("flags.txt", "outer.flags"):
    assert launch.workdir_of(
        ["python", "-m", "m", f"--flagfile={tmp_path / flagfile}"]) == "/r/d"
  assert launch.workdir_of(["python", f"--flagfile={tmp_path / 'flags.txt'}",
                            "--workdir=/r/e"]) == "/r/e"
  # A FIFO is refused without being opened (that would block).
  os.mkfifo(tmp_path / "fifo")
  with pytest.raises(launch.LaunchError, match="is a FIFO"):
    launch.workdir_of(["python", f"--flagfile={tmp_path / 'fifo'}"])
  with pytest.raises(launch.LaunchError, match="cannot read --flagfile=x"):
    launch.workdir_of(["python", "--flagfile=x"])


def test_a_resume_from_flags_txt_logs_to_its_workdir(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "flags.txt").write_text(f"--workdir={workdir}\n")
  result = run_launch("--num_workers=1", "--", sys.executable, "-c", "pass",
                      f"--flagfile={workdir / 'flags.txt'}", timeout=60)
  assert result.returncode == 0, result.stdout + result.stderr
  assert (workdir / "logs" / "worker-0.log").exists()


def test_a_failing_task_stops_the_others_and_its_exit_code_propagates(
    tmp_path, tasks):
  workdir = tmp_path / "run"
  result = run_launch("--num_workers=3", *tasks(FAIL_ONE),
                      f"--workdir={workdir}", timeout=60)
  assert result.returncode == 3, result.stdout
  tasks.check(workdir / "logs")
  # The failed task's tail is shown, naming it.
  assert "worker:1 failed (exit code 3)" in result.stdout
  assert "| boom: worker 1 gives up" in result.stdout
  # Every task got its own TF_CONFIG and log; lines are prefixed.
  for i in range(3):
    log = (workdir / "logs" / f"worker-{i}.log").read_text()
    assert f"task worker {i}" in log
    assert f"[worker:{i}] task worker {i}" in result.stdout


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130),
                                       (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_are_forwarded_to_every_task(sig, code, tmp_path,
                                                        tasks):
  """The launcher passes the signal on and exits 128 + N, as the train
  command does (docs/reliability.md's table of exit codes)."""
  log_dir = tmp_path / "logs"
  launcher = subprocess.Popen(
      [sys.executable, "-m", "tools.launch", "--num_workers=2",
       f"--log_dir={log_dir}", "--timeout_s=50", *tasks(TRAP_SIGINT)],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    logs = [log_dir / f"worker-{i}.log" for i in range(2)]
    deadline = time.monotonic() + 30
    while not all(p.exists() and "ready" in p.read_text() for p in logs):
      assert time.monotonic() < deadline, "tasks did not start"
      time.sleep(0.1)
    launcher.send_signal(sig)
    out, _ = launcher.communicate(timeout=30)
  finally:
    if launcher.poll() is None:
      launcher.kill()
  assert launcher.returncode == code, out
  for p in logs:
    assert f"got {sig.name}" in p.read_text()
  tasks.check(log_dir)


def test_command_without_workdir_needs_log_dir():
  result = subprocess.run(
      [sys.executable, "-m", "tools.launch", "--num_workers=1", "--",
       sys.executable, "-c", "pass"], cwd=REPO, capture_output=True,
      text=True, timeout=30, env=dict(os.environ))
  assert result.returncode == 2
  assert "--log_dir" in result.stderr


def _launch_failing(workdir, task, fails, *launcher_args, code=1,
                    tasks=Tasks(False, None)):
  result = run_launch(*launcher_args, *tasks(FAIL_FIRST_RUNS),
                      f"--workdir={workdir}", str(fails), task, str(code),
                      timeout=60)
  tasks.check(workdir / "logs")
  return result


def _restart_lines(out):
  return [line for line in out.splitlines() if "failed" in line and
          "; restart " in line]


def _runs(workdir, task):
  return (workdir / f"runs-{task}").read_text().splitlines()


def test_max_restarts_restarts_the_whole_cluster_with_the_same_command(
    tmp_path, tasks):
  workdir = tmp_path / "run"
  result = _launch_failing(workdir, "worker:1", 2, "--num_workers=2",
                           "--max_restarts=3", tasks=tasks)
  assert result.returncode == 0, result.stdout
  assert _restart_lines(result.stdout) == [
      f"[launch] worker:1 failed (exit code 1); restart {k} of 3: stopping "
      "every task and restarting the cluster (log "
      f"{workdir / 'logs' / 'worker-1.log'})" for k in (1, 2)]
  # Every task ran three times, on the same cluster (the ports were free).
  for task in ("worker-0", "worker-1"):
    runs = _runs(workdir, task)
    assert len(runs) == 3 and len(set(runs)) == 1
  log = (workdir / "logs" / "worker-0.log").read_text()
  assert "[launch] restart 2 of 3" in log


def test_a_task_killed_by_a_signal_is_restarted_and_named_so(tmp_path,
                                                             tasks):
  workdir = tmp_path / "run"
  result = _launch_failing(workdir, "worker:0", 1, "--num_workers=2",
                           "--max_restarts=2", code="SIGKILL", tasks=tasks)
  assert result.returncode == 0, result.stdout
  assert _restart_lines(result.stdout) == [
      "[launch] worker:0 failed (killed by signal 9); restart 1 of 2: "
      "stopping every task and restarting the cluster (log "
      f"{workdir / 'logs' / 'worker-0.log'})"]
  assert len(_runs(workdir, "worker-1")) == 2


def test_after_max_restarts_the_failing_tasks_code_is_the_exit_code(
    tmp_path):
  workdir = tmp_path / "run"
  result = _launch_failing(workdir, "worker:0", 99, "--num_workers=2",
                           "--max_restarts=1")
  assert result.returncode == 1, result.stdout
  assert len(_restart_lines(result.stdout)) == 1
  assert "worker:0 failed (exit code 1); last lines of" in result.stdout
  assert len(_runs(workdir, "worker-1")) == 2


def test_a_diverged_run_is_not_restarted(tmp_path):
  """A restart would diverge the same way: the launcher reports it at
  once."""
  workdir = tmp_path / "run"
  result = _launch_failing(workdir, "worker:1", 99, "--num_workers=2",
                           "--max_restarts=2", code=3)
  assert result.returncode == 3, result.stdout
  assert not _restart_lines(result.stdout)
  assert "worker:1 failed (exit code 3); last lines of" in result.stdout
  assert len(_runs(workdir, "worker-1")) == 1


def test_a_lost_ps_restarts_a_ps_cluster_and_a_lost_worker_does_not(
    tmp_path, tasks):
  workdir = tmp_path / "run"
  result = _launch_failing(workdir, "ps:0", 1, "--num_workers=1",
                           "--num_ps=1", "--max_restarts=2", tasks=tasks)
  assert result.returncode == 0, result.stdout
  assert len(_restart_lines(result.stdout)) == 1
  assert len(_runs(workdir, "chief-0")) == 2
  result = _launch_failing(tmp_path / "run2", "worker:0", 99,
                           "--num_workers=1", "--num_ps=1",
                           "--max_restarts=2", tasks=tasks)
  assert result.returncode == 0, result.stdout
  assert "training goes on" in result.stdout
  assert not _restart_lines(result.stdout)


def test_a_restart_is_recorded_and_splits_the_downtime_before_it(tmp_path,
                                                                  tasks):
  """The launcher's record (logs/launch.jsonl) of a run restarted once
  after a SIGKILL, and the downtime of the restart as goodput splits it:
  in tools.goodput's table and in the restarted attempt's own totals. A
  forked task's process starts at its fork: goodput finds it by its PID."""
  workdir = tmp_path / "run"
  result = run_launch("--num_workers=1", "--max_restarts=1", *tasks(ATTEMPTS),
                      f"--workdir={workdir}", timeout=60)
  assert result.returncode == 0, result.stdout
  tasks.check(workdir / "logs")
  events = [e for e in launch_record.read(str(workdir / "logs" /
                                              "launch.jsonl"))
            if e["event"] != "fork_server"]
  assert [e["event"] for e in events] == [
      "start", "failed", "stopped", "waited", "start", "exit"]
  _, failed, stopped, waited, restart, end = events
  assert (failed["task"], failed["code"]) == ("worker:0", -signal.SIGKILL)
  assert failed["t"] <= failed["detected"] <= stopped["t"] <= waited["t"]
  assert waited["ports_free"] and end["code"] == 0
  attempts = goodput.read(str(workdir / goodput.GOODPUT_FILE))
  assert [[a["pid"]] for a in attempts] == [
      list(e["tasks"].values()) for e in (events[0], restart)]
  parts = goodput.downtime(*attempts, events)
  assert sum(parts.values()) == pytest.approx(
      attempts[1]["started"] - attempts[0]["t"])
  assert parts["unrecorded"] >= LOST_S  # It slept, then died.
  assert parts["other"] == 0.0
  # The restarted attempt's totals read the record as the tool does.
  [line] = [l for l in result.stdout.splitlines() if " totals " in l]
  totals = json.loads(line.split(" totals ", 1)[1])
  for part, seconds in parts.items():
    assert totals[f"downtime_{part}"] == pytest.approx(seconds)
  plot = tmp_path / "goodput.png"
  shown = run_tool("tools.goodput", str(workdir), f"--plot={plot}")
  assert shown.returncode == 0, shown.stderr
  row = next(l for l in shown.stdout.splitlines() if l.startswith(
      "| chief 2 | worker:0, killed by signal 9 |"))
  assert [float(c) for c in row.strip("| ").split(" | ")[2:]] == (
      pytest.approx([parts[p] for p in launch_record.PARTS]
                    + [sum(parts.values())], abs=0.006))
  assert plot.stat().st_size > 0


def test_a_restart_waits_for_the_ports_of_the_stopped_cluster():
  port = launch.free_ports(1)[0]
  spec = {"worker": [f"localhost:{port}"]}
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  server.bind(("", port))
  server.listen()
  try:
    assert not local_cluster.ports_free(spec)
    assert not local_cluster.wait_for_ports(spec, timeout_s=0.3)
  finally:
    server.close()
  assert local_cluster.wait_for_ports(spec, timeout_s=5)


# -- bad input: one line, exit 2, nothing started --


@pytest.fixture(name="signals_kept")
def _signals_kept():
  """`launch.main` installs its own SIGINT/SIGTERM handlers; restore
  pytest's."""
  saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT,
                                                  signal.SIGTERM)}
  yield
  for sig, handler in saved.items():
    signal.signal(sig, handler)


@pytest.mark.parametrize("launcher_args, command, message", [
    ([], "{python} -c pass --workdir={file}",
     "--workdir={file} is a file; pass a directory"),
    (["--log_dir={file}/logs"], "{python} -c pass",
     "cannot create the log directory {file}/logs (Not a directory)"),
    ([], "no-such-command-1234 --workdir={dir}",
     "command 'no-such-command-1234' not found or not executable"),
    ([], "{file} --workdir={dir}", "command '{file}' not found or not "
     "executable"),
    (["--num_workers=0"], "{python} --workdir={dir}", "--num_workers=0: use "
     "a number >= 1"),
    (["--num_workers=x"], "{python} --workdir={dir}", "argument "
     "--num_workers: invalid int value: 'x'; usage: python -m tools.launch"),
    (["--num_ps=2"], "", "no command after --"),
    (["--num_workers=1", "--max_restarts=-1"], "{python} --workdir={dir}",
     "--max_restarts=-1: use a number >= 0"),
    (["--num_workers=1", "--timeout_s=-5"], "{python} --workdir={dir}",
     "--timeout_s=-5.0: use a number >= 0"),
    (["--num_workers=1", "--cpus_per_task=some"], "{python} --workdir={dir}",
     "'some' is not auto or a number of cores"),
    (["--num_workers=2", "--cpus_per_task=100000"],
     "{python} --workdir={dir}", "--cpus_per_task=100000 for 2 tasks needs "
     "200000 cores"),
    (["--num_workers=1", "--cpus_per_task=-1"], "{python} --workdir={dir}",
     "--cpus_per_task=-1: use a number >= 0"),
    (["--preload=tensorflow,a-b"], "{python} -m m --workdir={dir}",
     "'a-b' is not a module name"),
    (["--num_data_workers=-1"], "{python} --workdir={dir}",
     "--num_data_workers=-1: use a number >= 0"),
    (["--num_workers=1000000"], "{python} --workdir={dir}",
     "1000000 tasks need about 2000064 open files, and this process may "
     "open"),
    ([], "{python} -c pass --workdir=", "--workdir is empty; name the run's "
     "directory"),
    ([], "{python} -c pass --flagfile={dir}/flags.txt",
     "cannot read --flagfile={dir}/flags.txt: No such file or directory"),
])
def test_bad_input_is_one_line_and_starts_nothing(
    launcher_args, command, message, tmp_path, capsys, signals_kept):
  del signals_kept
  values = dict(python=sys.executable, file=tmp_path / "a_file",
                dir=tmp_path / "run")
  (tmp_path / "a_file").write_text("not a directory\n")
  if "--num_workers" not in " ".join(launcher_args):
    launcher_args = ["--num_workers=2", *launcher_args]
  argv = [a.format(**values) for a in launcher_args] + ["--"] + [
      a.format(**values) for a in command.split()]
  assert launch.main(argv) == 2
  out, err = capsys.readouterr()
  assert err.splitlines() == [err.strip()], err
  assert err.startswith("error: ") and message.format(**values) in err, err
  assert not out  # Not one task was started.
  assert not (tmp_path / "run").exists()


def test_an_empty_workdir_creates_nothing_here(tmp_path, monkeypatch,
                                               signals_kept):
  del signals_kept
  monkeypatch.chdir(tmp_path)
  assert launch.main(["--num_workers=1", "--", sys.executable, "-c", "pass",
                      "--workdir="]) == 2
  assert not os.listdir(tmp_path)


def test_too_many_ports_is_an_error_naming_the_fix():
  """Past the open-file limit, free_ports says so instead of failing with
  an OSError."""
  result = subprocess.run(
      [sys.executable, "-c",
       "import resource\n"
       "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit("
       "resource.RLIMIT_NOFILE)[1]))\n"
       "from tools.local_cluster import free_ports\n"
       "try:\n  free_ports(100)\nexcept ValueError as e:\n  print(e)\n"],
      cwd=REPO, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("cannot reserve 100 free localhost ports "
                                  "(Too many open files after "), result.stdout
  assert result.stdout.rstrip().endswith(
      "use fewer tasks or raise the open-file limit (ulimit -n)")


def test_a_live_run_s_workdir_is_refused_before_anything_is_written(
    tmp_path, capsys, signals_kept):
  """The lock of a live run (here this process's) refuses a second launch
  before it writes its logs or record into the run's logs."""
  from dist_loop.runtime import lock  # pylint: disable=g-import-not-at-top
  del signals_kept
  workdir = tmp_path / "run"
  logs = workdir / "logs"
  logs.mkdir(parents=True)
  (logs / "worker-0.log").write_text("the live run's log\n")
  (logs / launch_record.FILE_NAME).write_text('{"event": "start"}\n')
  before = {p.name: p.read_text() for p in logs.iterdir()}
  for name in ("lock", "lock.worker-1"):
    with lock.Lock(str(workdir), name):
      assert launch.main(["--num_workers=2", "--", sys.executable, "-c",
                          "pass", f"--workdir={workdir}"]) == 2
      out, err = capsys.readouterr()
      assert err == (f"error: --workdir={workdir} is in use by another run "
                     f"(pid {os.getpid()}, lock {workdir / name}); wait for "
                     "it to end, stop it, or use another --workdir\n")
      assert not out
      assert {p.name: p.read_text() for p in logs.iterdir()} == before
  # Free again: the launch runs, and appends to the record.
  assert launch.main(["--num_workers=1", "--", sys.executable, "-c", "pass",
                      f"--workdir={workdir}"]) == 0
  record = (logs / launch_record.FILE_NAME).read_text()
  assert record.startswith(before[launch_record.FILE_NAME]) and (
      record != before[launch_record.FILE_NAME])


# A command that refuses its flags, as absl ends one, writing nothing.
REFUSES_ITS_FLAGS = """
print("FATAL Flags parsing error: Unknown command line flag 'stepz'")
raise SystemExit(1)
"""


def test_a_command_that_refuses_its_flags_leaves_no_new_workdir(tmp_path,
                                                                tasks):
  workdir = tmp_path / "new" / "run"
  result = run_launch("--num_workers=2", *tasks(REFUSES_ITS_FLAGS),
                      f"--workdir={workdir}", timeout=60)
  assert result.returncode == 1, result.stdout
  assert "failed (exit code 1); last lines of" in result.stdout
  assert (f"[launch] the command refused its flags before writing "
          f"anything; removed {tmp_path / 'new'}, which this launch created "
          "for its logs") in result.stdout
  assert not (tmp_path / "new").exists()
  # A workdir that existed is left as it was; a log directory that existed
  # (an earlier run's) keeps what this one appended.
  workdir.mkdir(parents=True)
  for expected in ([], ["logs"]):
    result = run_launch("--num_workers=1", *tasks(REFUSES_ITS_FLAGS),
                        f"--workdir={workdir}", timeout=60)
    assert result.returncode == 1, result.stdout
    assert os.listdir(workdir) == expected
    assert ("removed" in result.stdout) == (not expected), result.stdout
    (workdir / "logs").mkdir(exist_ok=True)
  assert "FATAL Flags" in (workdir / "logs" / "worker-0.log").read_text()


def _children(pid):
  """The PIDs and command lines of the processes whose parent is `pid`."""
  found = {}
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/stat", encoding="ascii") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmdline = f.read().decode(errors="replace").split("\0")
    except (OSError, ValueError, IndexError):
      continue
    if ppid == pid:
      found[int(entry)] = cmdline
  return found


def test_a_killed_launcher_leaves_no_data_service(tmp_path):
  launcher = subprocess.Popen(
      [sys.executable, "-m", "tools.launch", "--num_workers=1",
       "--num_data_workers=1", f"--log_dir={tmp_path / 'logs'}",
       "--timeout_s=50", "--", sys.executable, "-c",
       "import time; time.sleep(60)"], cwd=REPO, stdout=subprocess.DEVNULL,
      stderr=subprocess.STDOUT)
  pids = []
  try:
    deadline = time.monotonic() + 30
    while not pids:
      assert launcher.poll() is None and time.monotonic() < deadline
      pids = [pid for pid, cmdline in _children(launcher.pid).items()
              if "tools.data_service" in cmdline]
      time.sleep(0.1)
    _kill_and_expect_gone(launcher, pids)
  finally:
    _reap(launcher, pids)


def test_no_command_is_one_line_without_a_traceback():
  result = subprocess.run(
      [sys.executable, "-m", "tools.launch", "--num_workers=2", "--", "nope-x",
       "--workdir=/tmp/x"], cwd=REPO, capture_output=True, text=True,
      timeout=60)
  assert result.returncode == 2
  assert result.stderr == ("error: command 'nope-x' not found or not "
                           "executable; check the command after --\n")
  assert not result.stdout


# -- cores and the terminal --


def test_cpu_sets_give_each_task_its_share():
  assert local_cluster.cpu_sets(4, None, range(8)) == [[0, 1], [2, 3],
                                                       [4, 5], [6, 7]]
  assert local_cluster.cpu_sets(2, None, [5, 7, 9]) == [[5], [7]]
  assert local_cluster.cpu_sets(2, 1, [5, 7, 9]) == [[5], [7]]
  assert local_cluster.cpu_sets(3, None, [0, 1]) is None  # Too few: shared.
  assert local_cluster.cpu_sets(2, 0, range(8)) is None
  with pytest.raises(ValueError, match="needs 6 cores"):
    local_cluster.cpu_sets(2, 3, range(4))


def _cores(log):
  """What SHOW_CORES printed in a task's log."""
  lines = log.read_text().splitlines()
  cores = [line for line in lines if line.startswith("cores ")]
  level = [line for line in lines if line.startswith("native log level ")]
  return eval(cores[0][len("cores "):]), level[0].rsplit(" ", 1)[1]  # pylint: disable=eval-used


@pytest.mark.parametrize("cpus_per_task", ["1", "auto"])
def test_each_task_runs_on_its_own_cores(cpus_per_task, tmp_path, tasks):
  available = sorted(os.sched_getaffinity(0))
  workers = min(2, len(available))
  share = 1 if cpus_per_task == "1" else len(available) // workers
  workdir = tmp_path / "pinned"
  result = run_launch(f"--num_workers={workers}",
                      f"--cpus_per_task={cpus_per_task}", "--verbosity=1",
                      *tasks(SHOW_CORES), f"--workdir={workdir}", timeout=60)
  assert result.returncode == 0, result.stdout
  tasks.check(workdir / "logs")
  for i in range(workers):
    cores = available[i * share:(i + 1) * share]
    assert _cores(workdir / "logs" / f"worker-{i}.log") == (cores, "1")
    assert re.search(rf"\[launch\] started worker:{i} \(pid \d+\) on cpus "
                     rf"{','.join(map(str, cores))}, log ", result.stdout)
    assert f"[launch] worker:{i}: TF_CONFIG=" in result.stdout


def test_auto_shares_the_cores_when_there_are_fewer_than_tasks(tmp_path):
  available = sorted(os.sched_getaffinity(0))
  workdir = tmp_path / "shared"
  result = run_launch(f"--num_workers={len(available) + 1}", "--", sys.executable,
                      "-c", SHOW_CORES, f"--workdir={workdir}", timeout=60)
  assert result.returncode == 0, result.stdout
  assert result.stdout.count("the tasks share them") == 1, result.stdout
  assert " on cpus " not in result.stdout
  assert "TF_CONFIG=" not in result.stdout  # Only from --verbosity=1.
  for i in range(len(available) + 1):
    assert _cores(workdir / "logs" / f"worker-{i}.log") == (available, "3")


def test_at_verbosity_minus_one_only_failures_are_said(tmp_path):
  result = _launch_failing(tmp_path / "run", "worker:0", 99,
                           "--num_workers=2", "--verbosity=-1")
  assert result.returncode == 1, result.stdout
  said = [line for line in result.stdout.splitlines()
          if line.startswith("[launch]")]
  assert len(said) == 1 and "worker:0 failed (exit code 1)" in said[0]


# Records its run in WORKDIR/runs-<job>-<i>, prints argv[2] and exits with
# argv[3]: a usage error, as absl or argparse ends a command.
USAGE_ERROR = """
import json, os, sys
task = json.loads(os.environ["TF_CONFIG"])["task"]
workdir = sys.argv[1].split("=", 1)[1]
os.makedirs(workdir, exist_ok=True)
with open(os.path.join(workdir, f"runs-{task['type']}-{task['index']}"),
          "a") as f:
  f.write("run\\n")
print(sys.argv[2], flush=True)
sys.exit(int(sys.argv[3]))
"""


@pytest.mark.parametrize("line, code", [
    ("FATAL Flags parsing error: Unknown command line flag 'train_stepz'", 1),
    ("usage: train [-h]; error: unrecognized arguments: --x", 2),
])
def test_a_usage_error_is_never_restarted(line, code, tmp_path, tasks):
  workdir = tmp_path / "run"
  result = run_launch("--num_workers=2", "--max_restarts=3",
                      *tasks(USAGE_ERROR), f"--workdir={workdir}", line,
                      str(code), timeout=60)
  assert result.returncode == code, result.stdout
  tasks.check(workdir / "logs")
  assert not _restart_lines(result.stdout)
  assert f"failed (exit code {code}); last lines of" in result.stdout
  # Each task ran once at most (the first to fail stops the other).
  runs = [len(p.read_text().splitlines()) for p in workdir.glob("runs-*")]
  assert runs and max(runs) == 1, runs


def test_an_exit_1_without_absl_s_line_is_still_restarted(tmp_path):
  workdir = tmp_path / "run"
  result = run_launch("--num_workers=1", "--max_restarts=1", "--",
                      sys.executable, "-c", USAGE_ERROR, f"--workdir={workdir}",
                      "error: a peer worker failed", "1", timeout=60)
  assert result.returncode == 1
  assert len(_restart_lines(result.stdout)) == 1
  assert len(_runs(workdir, "worker-0")) == 2


# worker:1 kills itself; worker:0 exits 1 as soon as worker:1 is dead (a
# zombie, until the launcher reaps it), as a peer of a lost worker does.
PEER_OF_THE_KILLED = """
import json, os, signal, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
pid_file = os.path.join(sys.argv[1], "worker-1.pid")
if task["index"] == 1:
  with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
  os.rename(pid_file + ".tmp", pid_file)
  os.kill(os.getpid(), signal.SIGKILL)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
  try:
    pid = open(pid_file).read()
    if open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] in "ZX":
      break
  except OSError:
    pass
  time.sleep(0.005)
print("error: a peer worker failed", flush=True)
sys.exit(1)
"""


def test_the_task_that_failed_first_is_named(tmp_path, monkeypatch):
  """Both have ended by the launcher's next look (a slow poll here): the
  report names worker:1, killed first, not worker:0 that followed."""
  from tools import supervisor  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(supervisor, "POLL_S", 1.5)
  launcher = supervisor.Launcher(
      [sys.executable, "-c", PEER_OF_THE_KILLED, str(tmp_path)], 2,
      log_dir=str(tmp_path / "logs"), quiet=True, timeout_s=40,
      cpus_per_task=0, verbosity=-1)
  launcher.start()
  try:
    code = launcher.wait()
  finally:
    launcher.stop()
  assert code == 128 + signal.SIGKILL
  assert [t.poll() for t in launcher.tasks.values()] == [1, -signal.SIGKILL]


def test_help_says_what_a_timeout_of_zero_means(capsys):
  with pytest.raises(SystemExit) as done:
    launch.main(["--help", "--", "true"])
  assert done.value.code == 0
  help_text = " ".join(capsys.readouterr().out.split())
  assert "--timeout_s TIMEOUT_S stop everything and exit 124 after this " \
         "many seconds (0, the default: no time limit)" in help_text


# -- the fork server --


def test_a_module_command_of_this_interpreter_is_forked():
  python = sys.executable
  assert fork_server.module_command([python, "-m", "pkg.mod", "--x=1"]) == (
      "pkg.mod", ["--x=1"])
  # The same interpreter by another path to it (a link to it, in its
  # directory: a virtualenv's python3 for its python).
  same = os.path.join(os.path.dirname(python), ".", os.path.basename(python))
  assert fork_server.module_command([same, "-m", "m"]) == ("m", [])
  for command in ([python, "-c", "pass"], [python, "script.py"],
                  [python, "-m"], [python, "-u", "-m", "m"],
                  ["/no/such/python", "-m", "m"], ["sh", "-m", "m"]):
    assert fork_server.module_command(command) is None, command


# Forked from a fork server that imported TensorFlow: says what it found at
# its start; sets TensorFlow's native log level as experiments.train does
# from its --verbosity (worker 0 at 1, worker 1 at 0, the launcher's), and
# has TensorFlow log a native warning; then waits to be killed.
FORKED_TASK = """
import json, os, sys, time
preloaded = "tensorflow" in sys.modules
from dist_loop.runtime import console, goodput
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
console.start(1 if index == 0 else 0)
import tensorflow as tf
for _ in tf.data.Dataset.range(4).cache().take(1):  # A native warning.
  pass
print("report", json.dumps({
    "preloaded": preloaded, "started": goodput.process_start_time(),
    "parent": os.getppid(), "own session": os.getsid(0) == os.getpid(),
    "name": __name__, "argv": sys.argv[1:]}), flush=True)
time.sleep(120)
"""


def _reports(logs, launcher, timeout_s=120):
  """What each task of FORKED_TASK reported, once all have."""
  deadline = time.monotonic() + timeout_s
  while True:
    texts = [p.read_text() if p.exists() else "" for p in logs]
    if all("report " in t for t in texts):
      return [json.loads(t.split("report ", 1)[1].splitlines()[0])
              for t in texts], texts
    assert launcher.poll() is None and time.monotonic() < deadline, texts
    time.sleep(0.2)


def _running(pid):
  """Whether process `pid` exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _kill_and_expect_gone(launcher, pids):
  """SIGKILLs `launcher`; fails unless every one of `pids` is gone within
  20 s (the kernel kills them with it)."""
  launcher.kill()
  launcher.wait(timeout=10)
  deadline = time.monotonic() + 20
  while any(map(_running, pids)):
    assert time.monotonic() < deadline, [p for p in pids if _running(p)]
    time.sleep(0.1)


def _reap(launcher, pids):
  """A test's cleanup, whatever it asserted: no launcher and none of
  `pids` left running."""
  if launcher.poll() is None:
    launcher.kill()
    launcher.wait(timeout=10)
  for pid in filter(_running, pids):
    os.kill(pid, signal.SIGKILL)


def test_forked_tasks_skip_tensorflow_s_import_and_end_with_the_launcher(
    tmp_path, monkeypatch):
  """The default fork server: each task finds TensorFlow imported, and its
  process starts at its fork, after the server's import (so goodput's
  `import` phase is the fork to `train.run`); it is a `python -m` process in
  a session of its own, and an entry point's own native log level takes
  effect. A SIGKILLed launcher leaves neither the server nor a task."""
  (tmp_path / "modules").mkdir()
  (tmp_path / "modules" / "forked_task.py").write_text(FORKED_TASK)
  monkeypatch.setenv("PYTHONPATH", str(tmp_path / "modules"))
  log_dir = tmp_path / "logs"
  launcher = subprocess.Popen(
      [sys.executable, "-m", "tools.launch", "--num_workers=2",
       f"--log_dir={log_dir}", "--timeout_s=200", "--", sys.executable, "-m",
       "forked_task", "a", "--b=c"], cwd=REPO, stdout=subprocess.DEVNULL,
      stderr=subprocess.STDOUT)
  pids = []
  try:
    reports, texts = _reports([log_dir / f"worker-{i}.log" for i in (0, 1)],
                              launcher)
    events = launch_record.read(str(log_dir / launch_record.FILE_NAME))
    [server] = [e for e in events if e["event"] == "fork_server"]
    [start] = [e for e in events if e["event"] == "start"]
    pids = [server["pid"], *start["tasks"].values()]
    for report in reports:
      assert report["preloaded"] and report["parent"] == server["pid"]
      # Clock ticks (/proc) and the clocks' reading: a few hundredths.
      assert report["started"] >= server["ready"] - 0.1, (report, server)
      assert report["own session"] and report["name"] == "__main__"
      assert report["argv"] == ["a", "--b=c"]
    warning = "did not fully read the dataset being cached"
    assert warning in texts[0] and warning not in texts[1], texts
    _kill_and_expect_gone(launcher, pids)
  finally:
    _reap(launcher, pids)


def test_a_fork_server_that_cannot_start_is_one_line_and_tasks_start_anew(
    tmp_path, monkeypatch):
  modules = tmp_path / "modules"
  modules.mkdir()
  (modules / "show_cores.py").write_text(SHOW_CORES)
  monkeypatch.setenv("PYTHONPATH", str(modules))
  workdir = tmp_path / "run"
  result = run_launch("--num_workers=2", "--preload=no_such_module_2718",
                      "--", sys.executable, "-m", "show_cores",
                      f"--workdir={workdir}", timeout=60)
  assert result.returncode == 0, result.stdout
  log = workdir / "logs" / "fork_server.log"
  [line] = [l for l in result.stdout.splitlines() if "fork server" in l]
  assert line == (
      "[launch] the fork server did not start (exit code 1: "
      "ModuleNotFoundError: No module named 'no_such_module_2718'; log "
      f"{log}); starting the tasks as new processes")
  for i in (0, 1):
    assert _cores(workdir / "logs" / f"worker-{i}.log")[1] == "3"
  [event] = [e for e in launch_record.read(str(workdir / "logs" /
                                               launch_record.FILE_NAME))
             if e["event"] == "fork_server"]
  assert "pid" not in event and "no_such_module_2718" in event["error"]


def test_a_task_the_fork_server_cannot_fork_starts_the_cluster_anew(
    tmp_path, monkeypatch, capsys):
  """The tasks it forked end with it: every task starts as a new process."""
  from tools import supervisor  # pylint: disable=g-import-not-at-top
  modules = tmp_path / "modules"
  modules.mkdir()
  (modules / "show_cores.py").write_text(SHOW_CORES)
  monkeypatch.setenv("PYTHONPATH", str(modules))
  forks = []

  def fork_once(self, *args):
    forks.append(args)
    if len(forks) == 2:
      raise fork_server.ForkServerError("no answer within 30 s")
    return real_fork(self, *args)

  real_fork = fork_server.ForkServer.fork
  monkeypatch.setattr(fork_server.ForkServer, "fork", fork_once)
  record = tmp_path / "logs" / launch_record.FILE_NAME
  launcher = supervisor.Launcher(
      [sys.executable, "-m", "show_cores"], 2, log_dir=str(tmp_path / "logs"),
      quiet=True, timeout_s=40, cpus_per_task=0, preload=["json"],
      record=str(record))
  launcher.start()
  try:
    code = launcher.wait()
  finally:
    launcher.stop()
  assert code == 0 and len(forks) == 2
  assert all(isinstance(t.process, subprocess.Popen)
             for t in launcher.tasks.values())
  assert ("[launch] the fork server cannot start worker:1 (no answer within "
          "30 s); starting the tasks as new processes") in (
              capsys.readouterr().out)
  assert [e["event"] for e in launch_record.read(str(record))] == [
      "fork_server", "start", "exit"]


# Records each of its runs in WORKDIR/runs-<job>-<i>; its first run waits to
# be killed, its second ends.
FIRST_RUN_WAITS = """
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
workdir = sys.argv[1].split("=", 1)[1]
with open(os.path.join(workdir, f"runs-{task['type']}-{task['index']}"),
          "a") as f:
  f.write("run\\n")
if len(open(f.name).read().splitlines()) == 1:
  time.sleep(60)
"""


def test_a_fork_server_that_dies_takes_its_tasks_and_a_restart_replaces_it(
    tmp_path, monkeypatch):
  """Its tasks die with it (PR_SET_PDEATHSIG), reported killed; the restart
  starts a new fork server."""
  modules = tmp_path / "modules"
  modules.mkdir()
  (modules / "first_run_waits.py").write_text(FIRST_RUN_WAITS)
  monkeypatch.setenv("PYTHONPATH", str(modules))
  workdir = tmp_path / "run"
  workdir.mkdir()
  launcher = subprocess.Popen(
      [sys.executable, "-m", "tools.launch", "--num_workers=2",
       "--max_restarts=1", "--timeout_s=50", "--preload=json", "--",
       sys.executable, "-m", "first_run_waits", f"--workdir={workdir}"],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    runs = [workdir / f"runs-worker-{i}" for i in (0, 1)]
    deadline = time.monotonic() + 30
    while not all(p.exists() for p in runs):
      assert launcher.poll() is None and time.monotonic() < deadline
      time.sleep(0.05)
    record = str(workdir / "logs" / launch_record.FILE_NAME)
    [server] = [e for e in launch_record.read(record)
                if e["event"] == "fork_server"]
    os.kill(server["pid"], signal.SIGKILL)
    out, _ = launcher.communicate(timeout=40)
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait(timeout=10)
  assert launcher.returncode == 0, out
  assert re.search(r"\[launch\] worker:\d failed \(killed by signal 9: "
                   r"the fork server died\); restart 1 of 1", out), out
  assert ("[launch] the fork server ended (killed by signal 9; log "
          f"{workdir / 'logs' / 'fork_server.log'}); starting a new one"
          ) in out
  servers = [e for e in launch_record.read(record)
             if e["event"] == "fork_server"]
  assert len({e["pid"] for e in servers}) == 2
  assert [len(p.read_text().splitlines()) for p in runs] == [2, 2]


def test_ctrl_c_while_the_fork_server_imports_starts_no_task(
    tmp_path, monkeypatch):
  modules = tmp_path / "modules"
  modules.mkdir()
  (modules / "slow_import.py").write_text(
      "import os, time\n"
      "open(os.path.join(os.path.dirname(__file__), 'importing'), 'w')\n"
      "time.sleep(60)\n")
  (modules / "task.py").write_text("print('started', flush=True)\n")
  monkeypatch.setenv("PYTHONPATH", str(modules))
  log_dir = tmp_path / "logs"
  launcher = subprocess.Popen(
      [sys.executable, "-m", "tools.launch", "--num_workers=2",
       f"--log_dir={log_dir}", "--timeout_s=50", "--preload=slow_import",
       "--", sys.executable, "-m", "task"], cwd=REPO,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 30
    while not (modules / "importing").exists():
      assert launcher.poll() is None and time.monotonic() < deadline
      time.sleep(0.05)
    launcher.send_signal(signal.SIGINT)
    out, _ = launcher.communicate(timeout=20)
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait(timeout=10)
  assert launcher.returncode == 130, out
  assert "started" not in out and not list(log_dir.glob("worker-*.log"))
  events = launch_record.read(str(log_dir / launch_record.FILE_NAME))
  assert [e["event"] for e in events] == ["exit"]
