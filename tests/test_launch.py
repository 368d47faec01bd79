"""The local launcher: per-task TF_CONFIG and logs, failures, Ctrl-C.

The tasks here are tiny Python programs, not training runs, so these tests
take seconds; tests/test_multiworker.py and tests/test_ps.py launch real
training.
"""

import os
import signal
import subprocess
import sys
import time

from conftest import REPO, run_launch

from tools import launch, local_cluster

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

# Says when it got SIGINT, then exits 130 like the train command does.
TRAP_SIGINT = """
import signal, sys, time
def on_int(*_):
  print("got SIGINT", flush=True)
  sys.exit(130)
signal.signal(signal.SIGINT, on_int)
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


def test_workdir_is_read_from_the_command():
  assert launch.workdir_of(["python", "--workdir=/r/a"]) == "/r/a"
  assert launch.workdir_of(["python", "--workdir", "/r/b"]) == "/r/b"
  assert launch.workdir_of(["python", "--flagfile=x"]) is None


def test_a_failing_task_stops_the_others_and_its_exit_code_propagates(
    tmp_path):
  workdir = tmp_path / "run"
  result = run_launch("--num_workers=3", "--", sys.executable, "-c", FAIL_ONE,
                      f"--workdir={workdir}", timeout=60)
  assert result.returncode == 3, result.stdout
  # The failed task's tail is shown, naming it.
  assert "worker:1 failed (exit code 3)" in result.stdout
  assert "| boom: worker 1 gives up" in result.stdout
  # Every task got its own TF_CONFIG and log; lines are prefixed.
  for i in range(3):
    log = (workdir / "logs" / f"worker-{i}.log").read_text()
    assert f"task worker {i}" in log
    assert f"[worker:{i}] task worker {i}" in result.stdout


def test_ctrl_c_is_forwarded_to_every_task(tmp_path):
  log_dir = tmp_path / "logs"
  launcher = subprocess.Popen(
      [sys.executable, "-m", "tools.launch", "--num_workers=2",
       f"--log_dir={log_dir}", "--timeout_s=50", "--", sys.executable, "-c",
       TRAP_SIGINT], cwd=REPO, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  try:
    logs = [log_dir / f"worker-{i}.log" for i in range(2)]
    deadline = time.monotonic() + 30
    while not all(p.exists() and "ready" in p.read_text() for p in logs):
      assert time.monotonic() < deadline, "tasks did not start"
      time.sleep(0.1)
    launcher.send_signal(signal.SIGINT)
    out, _ = launcher.communicate(timeout=30)
  finally:
    if launcher.poll() is None:
      launcher.kill()
  assert launcher.returncode == 130, out
  for p in logs:
    assert "got SIGINT" in p.read_text()


def test_command_without_workdir_needs_log_dir():
  result = subprocess.run(
      [sys.executable, "-m", "tools.launch", "--num_workers=1", "--",
       sys.executable, "-c", "pass"], cwd=REPO, capture_output=True,
      text=True, timeout=30, env=dict(os.environ))
  assert result.returncode == 2
  assert "--log_dir" in result.stderr
