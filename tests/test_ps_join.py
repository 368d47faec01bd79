"""A ps chief whose servers never start fails in one line, within
--join_timeout_s (TensorFlow's own connection waits for them forever).

`test_startup.py` tests the wait itself; this is the command that uses it.
"""

import json

from conftest import run_main
from tools import local_cluster


def test_a_ps_chief_without_its_servers_fails_in_one_line(
    monkeypatch, tmp_path):
  ports = local_cluster.free_ports(3)
  spec = local_cluster.cluster_spec(1, 1, ports)
  monkeypatch.setenv("TF_CONFIG", json.dumps(
      {"cluster": spec, "task": {"type": "chief", "index": 0}}))
  code, _, err = run_main("--mode=ps", "--dataset=synthetic", "--model=mlp",
                          "--global_batch_size=16", "--join_timeout_s=1",
                          f"--workdir={tmp_path / 'run'}")
  assert code == 1
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in err, err
  assert lines[0].startswith("error: worker:0 (localhost:") and (
      "did not start within --join_timeout_s=1" in lines[0]), err
