"""Joining a cluster is bounded: a task whose peers never start says once
what it waits for, then fails with one line naming the missing task.

Real processes for a multi-worker join: it is TensorFlow's start-up, once
per process. In process: the wait of a parameter-server chief for the
servers it connects to.
"""

import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import REPO
from dist_loop.runtime import strategy
from dist_loop.runtime.cluster import Cluster, ClusterError
from tools import local_cluster

JOIN_TIMEOUT_S = 2
# Our lines only: time-stamped, or the final `error:` line.
OUR_LINE = re.compile(r"^(\d\d:\d\d:\d\d |error: )")


def _start_worker(index, spec, workdir):
  env = {**os.environ, "TF_CONFIG": json.dumps(
      {"cluster": spec, "task": {"type": "worker", "index": index}}),
         # The old default, which showed TensorFlow's native errors.
         "TF_CPP_MIN_LOG_LEVEL": "2"}
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.train", "--dataset=synthetic",
       "--model=mlp", "--num_devices=1", "--global_batch_size=32",
       "--train_steps=2", f"--join_timeout_s={JOIN_TIMEOUT_S}",
       f"--workdir={workdir}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)


def test_a_task_whose_peer_never_starts_fails_in_one_line(tmp_path):
  """Worker 0 runs the coordination service and waits for worker 1;
  worker 1 of another cluster waits for its worker 0. Nobody listens on
  the missing tasks' ports. Both run at once."""
  ports = local_cluster.free_ports(4)
  clusters = [local_cluster.cluster_spec(2, 0, ports[:2]),
              local_cluster.cluster_spec(2, 0, ports[2:])]
  missing = [("worker:1", clusters[0]["worker"][1]),
             ("worker:0", clusters[1]["worker"][0])]
  workdirs = [tmp_path / "leader", tmp_path / "follower"]
  procs = [_start_worker(i, spec, workdir)
           for i, spec, workdir in zip((0, 1), clusters, workdirs)]
  try:
    results = [p.communicate(timeout=240) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for proc, (out, err), (name, address), index, workdir in zip(
      procs, results, missing, (0, 1), workdirs):
    assert proc.returncode == 1, err[-3000:]
    assert not out
    lines = err.splitlines()
    # TensorFlow's and gRPC's own error lines are hidden at --verbosity=0.
    assert all(OUR_LINE.match(line) for line in lines), err[-3000:]
    waiting = [line for line in lines if "waiting for" in line]
    assert len(waiting) == 1, err
    assert waiting[0].endswith(
        f"worker:{index}: waiting for {name} ({address}) to start; giving "
        f"up after --join_timeout_s={JOIN_TIMEOUT_S}")
    assert lines[-1].startswith(
        f"error: {name} ({address}) did not join the cluster within "
        f"--join_timeout_s={JOIN_TIMEOUT_S}; start every task"), err
    assert len(lines) == 2, err
    assert not workdir.exists()


def test_a_ps_chief_waits_for_its_servers_with_a_bound(caplog):
  ports = local_cluster.free_ports(3)
  cluster = Cluster(local_cluster.cluster_spec(1, 1, ports), "chief", 0)
  with contextlib.ExitStack() as stack:
    worker = stack.enter_context(socket.socket())
    worker.bind(("", ports[1]))
    worker.listen()
    with caplog.at_level(logging.INFO, logger="absl"):
      with pytest.raises(ClusterError) as error:
        strategy.wait_for_servers(cluster, timeout_s=1.0)
    assert str(error.value).startswith(
        f"ps:0 (localhost:{ports[2]}) did not start within "
        "--join_timeout_s=1; start every task")
    waiting = [r.getMessage() for r in caplog.records
               if "waiting for" in r.getMessage()]
    assert waiting == [f"chief:0: waiting for ps:0 (localhost:{ports[2]}) "
                       "to start; giving up after --join_timeout_s=1"]
    ps = stack.enter_context(socket.socket())
    ps.bind(("", ports[2]))
    ps.listen()
    strategy.wait_for_servers(cluster, timeout_s=1.0)  # Both up: returns.


def test_a_worker_registers_only_once_the_leader_listens(monkeypatch):
  """Worker 1 waits for worker 0, the coordination service's leader, to
  listen before it joins (gRPC would retry a refused registration only
  after its reconnect backoff); it gives up after the timeout in the join's
  one line; the leader waits for nobody."""
  ports = local_cluster.free_ports(2)
  spec = local_cluster.cluster_spec(2, 0, ports)
  follower = Cluster(spec, "worker", 1)
  polls = []
  monkeypatch.setattr(strategy.time, "sleep", polls.append)
  with pytest.raises(ClusterError) as error:
    strategy._wait_for_leader(follower, timeout_s=0.0)
  assert str(error.value) == (
      f"worker:0 (localhost:{ports[0]}) did not join the cluster within "
      "--join_timeout_s=0; start every task of the cluster with the same "
      "command, or check that worker:1 can reach them")
  with socket.socket() as leader:
    leader.bind(("", ports[0]))  # Bound, not listening: refused.

    def sleep(seconds):  # The leader starts to listen while worker 1 waits.
      polls.append(seconds)
      leader.listen()

    monkeypatch.setattr(strategy.time, "sleep", sleep)
    polls.clear()
    strategy._wait_for_leader(follower, timeout_s=60.0)
    assert polls == [strategy._LEADER_POLL_S]  # Then it returned.
  strategy._wait_for_leader(Cluster(spec, "worker", 0), timeout_s=0.0)
