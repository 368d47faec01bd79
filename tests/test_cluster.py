"""TF_CONFIG parsing: roles, the chief, and what is refused at the door."""

import json

import pytest

from dist_loop import Config, cluster
from dist_loop.errors import UserError


def _tf_config(spec, task_type, index):
  return json.dumps({"cluster": spec, "task": {"type": task_type,
                                               "index": index}})


def test_no_tf_config_is_one_chief_process():
  c = cluster.parse(None)
  assert c.is_chief and c.num_workers == 0 and c.num_tasks == 0
  assert c.num_trainers == 0


def test_worker_zero_is_chief_without_a_chief_task():
  spec = {"worker": ["a:1", "b:1"]}
  assert cluster.parse(_tf_config(spec, "worker", 0)).is_chief
  second = cluster.parse(_tf_config(spec, "worker", 1))
  assert not second.is_chief and second.num_trainers == 2


def test_ps_cluster_roles():
  spec = {"chief": ["c:1"], "worker": ["a:1", "b:1"], "ps": ["p:1"]}
  assert cluster.parse(_tf_config(spec, "chief", 0)).is_chief
  worker = cluster.parse(_tf_config(spec, "worker", 0))
  assert not worker.is_chief
  assert (worker.num_workers, worker.num_ps, worker.num_tasks) == (2, 1, 4)


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


@pytest.mark.parametrize("mode,spec,message", [
    ("async", {"worker": ["a:1", "b:1"]}, "runs in one process"),
    ("sync", {"chief": ["c:1"], "worker": ["a:1"], "ps": ["p:1"]},
     "use --mode=ps"),
    ("ps", {"worker": ["a:1", "b:1"]}, "tools.launch"),
])
def test_modes_check_the_cluster_at_the_door(mode, spec, message, monkeypatch,
                                             tmp_path):
  monkeypatch.setenv("TF_CONFIG", _tf_config(spec, "worker", 0))
  config = Config(workdir=str(tmp_path), mode=mode, dataset="synthetic",
                  model="mlp", global_batch_size=32)
  with pytest.raises(UserError, match=message):
    config.validate()


def test_multi_worker_sync_counts_every_workers_replicas(monkeypatch,
                                                          tmp_path):
  monkeypatch.setenv("TF_CONFIG",
                     _tf_config({"worker": ["a:1", "b:1", "c:1"]}, "worker", 2))
  config = Config(workdir=str(tmp_path), dataset="synthetic", model="mlp",
                  global_batch_size=32, device_type="cpu")
  with pytest.raises(UserError, match="not divisible by 3 replicas"):
    config.validate()
  with pytest.raises(UserError, match="one replica per worker"):
    config.replace(num_devices=2, global_batch_size=36).validate()
