"""TF_CONFIG parsing: roles, the chief, and what is refused at the door."""

import copy
import json
import pathlib
import random
import re

import pytest

from conftest import run_main
import dist_loop
from dist_loop import configure
from dist_loop.core.errors import UserError
from dist_loop.runtime import cluster

LIBRARY = pathlib.Path(dist_loop.__file__).parent


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


TWO_WORKERS = {"worker": ["a:1", "b:1"]}

# TF_CONFIG values of the wrong shape, and what the one line says.
BAD_SHAPES = [
    ("{not json", "not valid JSON"),
    ('["a:1", "b:1"]', "is a list, not a JSON object"),
    ('"worker"', "is the string 'worker', not a JSON object"),
    ("3", "is the number 3, not a JSON object"),
    ("null", "is null, not a JSON object"),
    (json.dumps({"clusters": TWO_WORKERS, "task": {"type": "worker"}}),
     "unknown keys ['clusters']"),
    (json.dumps({"cluster": ["a:1"], "task": {}}),
     '"cluster" that is a list'),
    (json.dumps({"cluster": {"worker": "localhost:1"},
                 "task": {"type": "worker", "index": 0}}),
     "as the string 'localhost:1'; write a list"),
    (json.dumps({"cluster": {"worker": []}, "task": {"type": "worker"}}),
     "as an empty list"),
    (json.dumps({"cluster": {"worker": {"0": "a:1"}}, "task": {}}),
     '"worker" as an object'),
    (json.dumps({"cluster": {"worker": ["a:1", 7]}, "task": {}}),
     "gives worker:1 the address 7"),
    (json.dumps({"cluster": {"worker": ["a"]}, "task": {}}),
     "the address 'a'; write \"host:port\""),
    (json.dumps({"cluster": {"worker": ["a:99999"]}, "task": {}}),
     "port from 1 to 65535"),
    (json.dumps({"cluster": {"worker": ["a:1", "a:1"]}, "task": {}}),
     "gives worker:0 and worker:1 the same address a:1"),
    (json.dumps({"cluster": TWO_WORKERS}), 'no "task"'),
    (json.dumps({"cluster": TWO_WORKERS, "task": "worker"}),
     '"task" that is the string \'worker\''),
    (json.dumps({"cluster": TWO_WORKERS, "task": ["worker", 0]}),
     '"task" that is a list'),
    (json.dumps({"cluster": TWO_WORKERS, "task": {"type": "worker",
                                                   "indx": 1}}),
     "unknown keys ['indx'] in \"task\""),
    (json.dumps({"cluster": TWO_WORKERS, "task": {"index": 0}}),
     "task type None is not a job of its cluster (worker)"),
    (json.dumps({"cluster": TWO_WORKERS, "task": {"type": ["worker"]}}),
     "task type ['worker'] is not a job"),
    (json.dumps({"cluster": TWO_WORKERS, "task": {"type": "worker",
                                                   "index": "x"}}),
     "task index 'x'; write an integer"),
    (json.dumps({"cluster": TWO_WORKERS, "task": {"type": "worker",
                                                   "index": "1"}}),
     "task index '1'; write an integer"),
    (json.dumps({"cluster": TWO_WORKERS, "task": {"type": "worker",
                                                   "index": True}}),
     "task index True"),
    (json.dumps({"cluster": TWO_WORKERS, "task": {"type": "worker",
                                                   "index": 1.0}}),
     "task index 1.0"),
    (_tf_config({"worker": ["a:1"], "evaluator": ["e:1"]}, "worker", 0),
     "tensorflow#46169"),
    (_tf_config({"worker": ["a:1"]}, "worker", 3),
     "task worker:3 is not in its cluster: job worker has 1 task"),
    (_tf_config({"worker": ["a:1"]}, "worker", -1), "is not in its cluster"),
    (_tf_config({"trainer": ["a:1"]}, "trainer", 0), "unknown jobs"),
]


@pytest.mark.parametrize("value,message", BAD_SHAPES)
def test_bad_tf_config_is_a_user_error(value, message):
  with pytest.raises(UserError) as error:
    cluster.parse(value)
  assert message in str(error.value)
  assert "\n" not in str(error.value)


def _paths(node, path=()):
  """Every place in a JSON document, as a tuple of keys and indices."""
  yield path
  items = (node.items() if isinstance(node, dict)
           else enumerate(node) if isinstance(node, list) else ())
  for key, child in items:
    yield from _paths(child, path + (key,))


def test_fuzzed_tf_config_shapes_parse_or_fail_in_one_line():
  """A valid TF_CONFIG with one place replaced by a value of another shape:
  either a consistent Cluster or one UserError line, never anything else."""
  valid = {"cluster": {"chief": ["c:1"], "worker": ["a:1", "b:2"],
                       "ps": ["p:3"]},
           "task": {"type": "worker", "index": 1}}
  values = [None, True, 0, -1, 2, 1.5, 10**20, "", "x", "worker",
            "localhost:1", "a:1", [], ["a:1"], [1], {}, {"type": "ps"},
            {"worker": ["z:9"]}]
  rng = random.Random(0)
  places = list(_paths(valid))
  outcomes = {"parsed": 0, "refused": 0}
  for _ in range(400):
    document, place = copy.deepcopy(valid), rng.choice(places)
    value = copy.deepcopy(rng.choice(values))
    if not place:
      document = value
    else:
      parent = document
      for key in place[:-1]:
        parent = parent[key]
      parent[place[-1]] = value
    text = json.dumps(document)
    try:
      parsed = cluster.parse(text)
    except UserError as e:
      assert "\n" not in str(e) and str(e).startswith("TF_CONFIG"), text
      outcomes["refused"] += 1
      continue
    outcomes["parsed"] += 1
    if parsed.spec:
      addresses = [a for _, a in parsed.tasks()]
      assert len(set(addresses)) == len(addresses), text
      assert all(re.fullmatch(r"[^:]+:\d+", a) for a in addresses), text
      assert 0 <= parsed.task_index < len(parsed.spec[parsed.task_type])
  assert min(outcomes.values()) > 10, outcomes  # Both kinds were tried.


@pytest.mark.parametrize("value,message", [BAD_SHAPES[1], BAD_SHAPES[7],
                                           BAD_SHAPES[15], BAD_SHAPES[20]])
def test_the_command_refuses_a_bad_tf_config_in_one_line(
    value, message, monkeypatch, tmp_path):
  monkeypatch.setenv("TF_CONFIG", value)
  code, out, err = run_main("--dataset=synthetic", "--model=mlp",
                            f"--workdir={tmp_path / 'run'}")
  assert code != 0 and not out
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and message in lines[0], err
  assert not (tmp_path / "run").exists()


def test_tasks_lists_every_task_with_its_address():
  spec = {"chief": ["c:1"], "worker": ["a:1", "b:1"]}
  assert cluster.parse(_tf_config(spec, "chief", 0)).tasks() == [
      ("chief:0", "c:1"), ("worker:0", "a:1"), ("worker:1", "b:1")]


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
  assert set(readers) == {"runtime/cluster.py", "train.py"}, readers
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
