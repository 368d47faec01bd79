"""Under SLURM, a step of several tasks (srun) is a cluster of workers.

A faked SLURM environment: the variables srun sets, and PATH without
nvidia-smi (a CPU node) or with a stub that lists GPUs.
"""

import os
import resource
import stat
import time

import pytest

from conftest import run_main
from dist_loop.core.errors import UserError
from dist_loop.runtime import cluster, slurm

# Task 1 of a step of 3 tasks on two nodes: two on node01, one on node02.
STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NODELIST": "node[01-02]",
        "SLURM_STEP_TASKS_PER_NODE": "2,1"}


@pytest.fixture(name="in_step")
def _in_step(monkeypatch, tmp_path):
  """Sets a SLURM step's variables (no TF_CONFIG, no GPUs); returns a
  function that changes them."""
  for name in [n for n in os.environ if n.startswith("SLURM_")] + [
      "TF_CONFIG", "CUDA_VISIBLE_DEVICES"]:
    monkeypatch.setenv(name, "")  # Restored after the test...
    monkeypatch.delenv(name)  # ...and absent during it.
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  monkeypatch.setenv("PATH", str(bin_dir))  # No nvidia-smi, no scontrol.

  def set_step(**changes):
    for name, value in {**STEP, **changes}.items():
      if value is None:
        monkeypatch.delenv(name, raising=False)
      else:
        monkeypatch.setenv(name, value)
    return bin_dir

  set_step()
  return set_step


def test_a_step_of_several_tasks_is_a_cluster_of_workers(in_step):
  del in_step
  base = slurm.port_base(4242, 0)
  assert cluster.current() == cluster.Cluster(
      {"worker": [f"node01:{base}", f"node01:{base + 1}",
                  f"node02:{base}"]}, "worker", 1)
  assert not cluster.current().is_chief


def test_task_zero_is_the_chief(in_step):
  in_step(SLURM_PROCID="0")
  assert cluster.current().task_name == "worker:0"
  assert cluster.current().is_chief


def test_tf_config_wins_over_slurm(in_step, monkeypatch):
  del in_step
  tf_config = ('{"cluster": {"worker": ["a:1", "b:1"]}, '
               '"task": {"type": "worker", "index": 0}}')
  monkeypatch.setenv("TF_CONFIG", tf_config)
  assert cluster.current() == cluster.parse(tf_config)


@pytest.mark.parametrize("changes", [
    dict(SLURM_STEP_NUM_TASKS="1", SLURM_STEP_NODELIST="node01",
         SLURM_STEP_TASKS_PER_NODE="1"),  # srun -n 1
    dict(SLURM_STEP_ID="4294967294"),  # The batch script's step.
    dict(SLURM_STEP_ID=None),  # An allocation, not a step.
    dict(SLURM_PROCID=None),
])
def test_a_single_task_or_no_step_is_one_process(in_step, changes):
  in_step(**changes)
  assert cluster.current() == cluster.Cluster()


@pytest.mark.parametrize("changes, message", [
    (dict(SLURM_STEP_NODELIST="node[01-"),
     "SLURM_STEP_NODELIST='node[01-' is not a host list"),
    (dict(SLURM_STEP_NODELIST="a:b,c d"),
     "SLURM_STEP_NODELIST='a:b,c d' has 'a:b', which is not a host name"),
    (dict(SLURM_STEP_NODELIST="node[03-01]"), "has the range [03-01]"),
    (dict(SLURM_STEP_NODELIST="node01"), "gives 2 nodes, but "
     "SLURM_STEP_NODELIST lists 1"),
    (dict(SLURM_STEP_TASKS_PER_NODE="two"),
     "SLURM_STEP_TASKS_PER_NODE='two' is not a list of task counts"),
    (dict(SLURM_STEP_NUM_TASKS="5"), "SLURM_STEP_NUM_TASKS=5, but "
     "SLURM_STEP_TASKS_PER_NODE='2,1' places 3 tasks"),
    (dict(SLURM_PROCID="7"), "SLURM_PROCID=7 is not a task of this SLURM "
     "step"),
    (dict(SLURM_JOB_ID="abc"), "SLURM_JOB_ID='abc' is not a number"),
    (dict(SLURM_PROCID="-1"), "SLURM_PROCID='-1' is not a number"),
    # Past SLURM's 32 bits; of thousands of digits, which Python will not
    # convert; a digit that is not a decimal one.
    (dict(SLURM_STEP_NUM_TASKS="4294967296"), "SLURM_STEP_NUM_TASKS="
     "'4294967296' is not a number from 0 to 4294967295"),
    (dict(SLURM_JOB_ID="9" * 5000), "is not a number from 0 to 4294967295"),
    (dict(SLURM_PROCID="\u00b2"), "SLURM_PROCID='\u00b2' is not a number"),
    (dict(SLURM_STEP_TASKS_PER_NODE="2,1(x" + "9" * 5000 + ")"),
     "is not a list of task counts like 2(x3),1"),
    (dict(SLURM_STEP_NODELIST="n[1-" + "9" * 5000 + "]"), "has the range"),
    (dict(SLURM_STEP_NODELIST="n" + "[0-9]" * 2000), "gives 2 nodes, but "
     "SLURM_STEP_NODELIST lists over 18446744073709551615"),
    (dict(CUDA_VISIBLE_DEVICES="0,1", SLURM_GPUS_PER_TASK="9" * 5000),
     "is not a GPU count"),
    (dict(CUDA_VISIBLE_DEVICES="0,1,2", SLURM_GPUS_PER_TASK="2"),
     "this task sees 3 GPUs (0,1,2), fewer than its node's 2 tasks of 2"),
])
def test_a_bad_slurm_environment_is_one_line(in_step, changes, message):
  in_step(**changes)
  with pytest.raises(UserError) as error:
    cluster.current()
  assert message in str(error.value) and "\n" not in str(error.value)
  assert "start every task with srun, or set TF_CONFIG" in str(error.value)


@pytest.mark.parametrize("changes, message", [
    (dict(SLURM_STEP_NODELIST="n[0-99999999]", SLURM_STEP_TASKS_PER_NODE="1"),
     "SLURM_STEP_TASKS_PER_NODE='1' gives 1 nodes, but SLURM_STEP_NODELIST "
     "lists 100000000"),
    (dict(SLURM_STEP_TASKS_PER_NODE="1(x999999999)"),
     "SLURM_STEP_TASKS_PER_NODE='1(x999999999)' gives 999999999 nodes, but "
     "SLURM_STEP_NODELIST lists 2"),
    (dict(SLURM_STEP_NODELIST="n[0-99999999],m", SLURM_STEP_TASKS_PER_NODE=
          "1(x99999999),1(x2)"), "SLURM_STEP_NUM_TASKS=2, but "
     "SLURM_STEP_TASKS_PER_NODE='1(x99999999),1(x2)' places 100000001 tasks"),
])
def test_a_huge_list_is_refused_before_it_is_expanded(in_step, changes,
                                                      message):
  """Lists that name 10**8 or 10**9 nodes, for a step of 2 tasks: counted,
  not expanded (which took a minute and gigabytes)."""
  in_step(SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="0", **changes)
  slurm._resolved.clear()  # pylint: disable=protected-access
  peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  start = time.monotonic()
  with pytest.raises(UserError) as error:
    cluster.current()
  assert time.monotonic() - start < 10
  # The process's peak memory grew by less than 100 MB (10**8 host names
  # take gigabytes).
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < peak_kb + 100_000
  assert message in str(error.value) and "\n" not in str(error.value)


def _nvidia_smi(bin_dir, monkeypatch, script):
  """A stub nvidia-smi on PATH that runs `script` (sh)."""
  smi = bin_dir / "nvidia-smi"
  smi.write_text("#!/bin/sh\n" + script)
  smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv("PATH", f"{bin_dir}:/bin:/usr/bin")  # sh for the stub.


TWO_GPUS = ("echo 'GPU 0: Stub (UUID: GPU-0)'\n"
            "echo 'GPU 1: Stub (UUID: GPU-1)'\n")


def test_gpu_nodes_give_each_task_its_gpus(in_step, monkeypatch):
  """With GPUs (a stub nvidia-smi that lists two per node), each task of a
  node gets its own."""
  bin_dir = in_step(SLURM_JOB_ID="4243")
  _nvidia_smi(bin_dir, monkeypatch, TWO_GPUS)
  assert cluster.current().task_name == "worker:1"
  assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"  # node01's second GPU.
  # Resolved once: the assignment does not change a second reading.
  assert cluster.current().task_name == "worker:1"


def test_ports_keep_jobs_and_steps_apart():
  """Steps 0-3 of a job and jobs less than 399 apart get disjoint blocks
  of ports, below the ephemeral range."""
  blocks = {}
  for job in range(1000, 1399):
    for step in range(4):
      base = slurm.port_base(job, step)
      assert base in slurm.PORTS and base + slurm.BLOCK - 1 in slurm.PORTS
      assert base % slurm.BLOCK == 0
      assert base not in blocks, (job, step, blocks.get(base))
      blocks[base] = (job, step)
  assert slurm.port_base(1000, 0) == slurm.port_base(1399, 0)  # Wraps.


def test_the_command_validates_the_step_as_its_cluster(in_step, tmp_path):
  """Through the flag layer: three SLURM tasks are three replicas."""
  del in_step
  code, _, err = run_main("--dataset=synthetic", "--model=mlp",
                          "--global_batch_size=32",
                          f"--workdir={tmp_path / 'run'}")
  assert code != 0
  assert "not divisible by 3 replicas" in err, err


def _layout(in_step, rank, **changes):
  """(task name, its CUDA_VISIBLE_DEVICES) of task `rank` of the step."""
  in_step(SLURM_PROCID=str(rank), **changes)
  slurm._resolved.clear()  # pylint: disable=protected-access
  return cluster.current().task_name, os.environ.get("CUDA_VISIBLE_DEVICES")


# 2 nodes of 2 tasks each.
FOUR = dict(SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)")


def test_gpus_per_task_one_keeps_each_tasks_own_gpu(in_step):
  """`srun --gpus-per-task=1`, 2 tasks per node: SLURM binds each task to
  its GPU, which each sees as 0; every task keeps it."""
  for rank in range(4):
    assert _layout(in_step, rank, CUDA_VISIBLE_DEVICES="0",
                   SLURM_GPUS_PER_TASK="1", **FOUR) == (f"worker:{rank}", "0")
    # The same without SLURM_GPUS_PER_TASK (--gres and --gpu-bind).
    assert _layout(in_step, rank, CUDA_VISIBLE_DEVICES="0",
                   **FOUR) == (f"worker:{rank}", "0")


def test_a_node_s_gpus_are_shared_out_among_its_tasks(in_step):
  """Tasks that see all of their node's GPUs get a share each, by their
  place on the node; SLURM_GPUS_PER_TASK fixes the share."""
  got = [_layout(in_step, r, CUDA_VISIBLE_DEVICES="4,5,6,7", **FOUR)[1]
         for r in range(4)]
  assert got == ["4,5", "6,7", "4,5", "6,7"]
  got = [_layout(in_step, r, CUDA_VISIBLE_DEVICES="0,1,2,3",
                 SLURM_GPUS_PER_TASK="tesla:1", **FOUR)[1] for r in range(4)]
  assert got == ["0", "1", "0", "1"]


def test_a_node_that_lists_no_gpus_is_a_cpu_node(in_step, monkeypatch):
  bin_dir = in_step()
  _nvidia_smi(bin_dir, monkeypatch, "echo 'No devices were found'\n")
  assert _layout(in_step, 1) == ("worker:1", None)
  assert _layout(in_step, 1, CUDA_VISIBLE_DEVICES="") == ("worker:1", "")


@pytest.mark.parametrize("script, message", [
    ("exec sleep 1000\n", "nvidia-smi --list-gpus did not answer in 1 s"),
    ("sleep 1000 &\necho 'GPU 0: Stub'\n",  # Its child holds the output.
     "nvidia-smi --list-gpus did not answer in 1 s"),
    ("echo 'NVIDIA-SMI has failed'\nexit 9\n",
     "nvidia-smi --list-gpus failed (exit code 9: NVIDIA-SMI has failed)"),
])
def test_nvidia_smi_is_bounded_and_its_failure_one_line(
    in_step, monkeypatch, script, message):
  bin_dir = in_step()
  _nvidia_smi(bin_dir, monkeypatch, script)
  monkeypatch.setattr(slurm, "NVIDIA_SMI_TIMEOUT_S", 1.0)
  slurm._resolved.clear()  # pylint: disable=protected-access
  with pytest.raises(UserError) as error:
    cluster.current()
  assert message in str(error.value) and "\n" not in str(error.value)
  assert "set CUDA_VISIBLE_DEVICES" in str(error.value)


def test_a_hanging_nvidia_smi_stops_the_entry_point_in_one_line(
    in_step, monkeypatch, tmp_path):
  """While the flags are parsed: exit non-zero, one line, no workdir."""
  bin_dir = in_step(SLURM_JOB_ID="4244")
  _nvidia_smi(bin_dir, monkeypatch, "exec sleep 1000\n")
  monkeypatch.setattr(slurm, "NVIDIA_SMI_TIMEOUT_S", 1.0)
  code, out, err = run_main("--dataset=synthetic", "--model=mlp",
                            f"--workdir={tmp_path / 'run'}")
  assert code != 0 and out == ""
  assert err.count("\n") == 1 and "did not answer in 1 s" in err, err
  assert not (tmp_path / "run").exists()
