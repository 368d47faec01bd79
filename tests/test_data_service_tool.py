"""tools.data_service as a user runs it: a port it cannot have is refused in
one line, before TensorFlow starts, and a second service on a port already
served is refused rather than sharing it."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import REPO, run_tool
from tools import data_service


@pytest.mark.parametrize("port", [-1, 65536, 70000])
def test_a_port_outside_the_tcp_range_is_one_line(port):
  result = run_tool("tools.data_service", f"--port={port}", timeout=60)
  assert result.returncode == 2
  assert result.stderr.splitlines() == [
      f"error: --port={port} is not a TCP port; use 1..65535, or 0 for a "
      "free one"]
  assert result.stdout == ""


def test_a_port_another_program_listens_on_is_refused():
  with socket.socket() as other:
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    result = run_tool("tools.data_service", f"--port={port}", timeout=60)
  assert result.returncode == 2
  assert result.stderr.splitlines() == [
      f"error: --port={port} is in use by another program; stop it, or pass "
      "another port, or 0 for a free one"]
  assert result.stdout == ""


def test_a_free_port_and_zero_are_accepted():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  assert data_service.port_problem(port) is None
  assert data_service.port_problem(0) is None  # A free one, chosen later.


@pytest.mark.timeout(180)
def test_a_second_service_on_the_same_port_is_refused():
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  first = subprocess.Popen(
      [sys.executable, "-m", "tools.data_service", "--num_workers=1",
       "--timeout_s=150"], cwd=REPO, stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL, text=True, env=env)
  try:
    address = first.stdout.readline().strip()
    assert address.startswith("grpc://localhost:"), address
    port = int(address.rsplit(":", 1)[1])
    second = run_tool("tools.data_service", "--num_workers=1",
                      f"--port={port}", timeout=60)
    assert second.returncode == 2
    assert second.stderr.splitlines() == [
        f"error: --port={port} is in use by another program; stop it, or "
        "pass another port, or 0 for a free one"]
    assert second.stdout == ""
  finally:
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=60)
