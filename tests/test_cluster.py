"""TF_CONFIG parsing: roles, the chief, and what is refused at the door."""

import json
import pathlib
import re

import pytest

from dist_loop import cluster, configure
from dist_loop.errors import UserError

LIBRARY = pathlib.Path(cluster.__file__).parent


def _tf_config(spec, task_type, index):
  return json.dumps({"cluster": spec, "task": {"type": task_type,
                                               "index": index}})


def test_no_tf_config_is_one_chief_process():
  for value in (None, "", json.dumps({"cluster": {}})):
    c = cluster.parse(value)
    assert c == cluster.Cluster() and c.task_name == "local:0"
    assert c.is_chief and c.num_workers == 0 and c.num_tasks == 0
    assert c.num_trainers == 0


def test_worker_zero_is_chief_without_a_chief_task():
  spec = {"worker": ["a:1", "b:1"]}
  assert cluster.parse(_tf_config(spec, "worker", 0)).is_chief
  second = cluster.parse(_tf_config(spec, "worker", 1))
  assert not second.is_chief and second.num_trainers == 2
  assert second.task_name == "worker:1"


def test_ps_cluster_roles():
  spec = {"chief": ["c:1"], "worker": ["a:1", "b:1"], "ps": ["p:1"]}
  assert cluster.parse(_tf_config(spec, "chief", 0)).is_chief
  worker = cluster.parse(_tf_config(spec, "worker", 0))
  assert not worker.is_chief
  assert (worker.num_workers, worker.num_ps, worker.num_tasks) == (2, 1, 4)
  assert worker.as_dict() == spec


@pytest.mark.parametrize("value,message", [
    ("{not json", "not valid JSON"),
    (_tf_config({"worker": ["a:1"], "evaluator": ["e:1"]}, "worker", 0),
     "tensorflow#46169"),
    (_tf_config({"worker": ["a:1"]}, "worker", 3), "not in its cluster"),
    (_tf_config({"trainer": ["a:1"]}, "trainer", 0), "unknown jobs"),
])
def test_bad_tf_config_is_a_user_error(value, message):
  with pytest.raises(UserError, match=message):
    cluster.parse(value)


def test_current_reads_tf_config(monkeypatch):
  spec = {"worker": ["a:1", "b:1"]}
  monkeypatch.setenv("TF_CONFIG", _tf_config(spec, "worker", 1))
  assert cluster.current() == cluster.parse(_tf_config(spec, "worker", 1))
  monkeypatch.delenv("TF_CONFIG")
  assert cluster.current() == cluster.Cluster()


def test_only_the_entry_point_reads_the_cluster_from_the_environment():
  """Below `train.run`, the cluster is passed down, never read again."""
  readers = {}
  for path in LIBRARY.rglob("*.py"):
    text = path.read_text(encoding="utf-8")
    calls = re.findall(r"\bcurrent\(\)|TFConfigClusterResolver|"
                       r"environ[^\n]*TF_CONFIG", text)
    if calls:
      readers[str(path.relative_to(LIBRARY))] = calls
  assert set(readers) == {"cluster.py", "train.py"}, readers
  assert readers["train.py"] == ["current()"]


@pytest.mark.parametrize("mode,spec,task,message", [
    ("async", {"worker": ["a:1", "b:1"]}, "worker", "runs in one process"),
    ("sync", {"chief": ["c:1"], "worker": ["a:1"], "ps": ["p:1"]}, "chief",
     "use --mode=ps"),
    ("ps", {"worker": ["a:1", "b:1"]}, "worker", "tools.launch"),
    ("ps", {"chief": ["c:1"], "ps": ["p:1"]}, "chief", "tools.launch"),
])
def test_modes_check_the_cluster_at_the_door(mode, spec, task, message,
                                             small_config):
  with pytest.raises(UserError, match=message):
    configure.validate(small_config(mode=mode),
                       cluster.parse(_tf_config(spec, task, 0)))


def test_multi_worker_sync_counts_every_workers_replicas(small_config):
  three = cluster.parse(
      _tf_config({"worker": ["a:1", "b:1", "c:1"]}, "worker", 2))
  with pytest.raises(UserError, match="not divisible by 3 replicas"):
    configure.validate(small_config(device_type="cpu"), three)
  with pytest.raises(UserError, match="one replica per worker"):
    configure.validate(small_config(device_type="cpu", num_devices=2,
                                    global_batch_size=36), three)
