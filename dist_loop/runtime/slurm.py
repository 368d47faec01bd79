"""A SLURM job step as a cluster of workers, through TensorFlow's own
`SlurmClusterResolver`.

Under SLURM, `srun python -m experiments.train ...` starts one task per
process; those tasks form the cluster without a `TF_CONFIG`. This module
decides only whether this process is one of several tasks of a step
(`in_step`); the layout (which task is which worker, on which node) is the
resolver's, which reads SLURM_PROCID, SLURM_STEP_NUM_TASKS,
SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE (TensorFlow 2.21 runs no
`scontrol`). The ports are ours (`port_base`): the resolver's default, 8888
for every job, collides when two jobs share a node.
"""

import os
import shutil
from typing import Dict, List, Mapping, Tuple

from dist_loop.core.errors import UserError

# A step's ports: below Linux's default ephemeral range (32768 and up),
# where no outgoing connection is given one, and above most services.
PORTS = range(20000, 32768)
# Each step gets a block of this many ports on every node (its tasks on a
# node listen on consecutive ports); blocks are numbered job * 4 + step.
BLOCK = 8
_STEPS_PER_JOB = 4
# Step IDs from here up are SLURM's special steps (the batch script, the
# extern step, an interactive allocation), never an srun of the train
# command.
_FIRST_SPECIAL_STEP = 0xFFFFFFF0


def in_step(environ: Mapping[str, str]) -> bool:
  """Whether this process is one task of a SLURM job step (an srun) of
  several tasks."""
  try:
    step, tasks = (int(environ[name])
                   for name in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"))
  except (KeyError, ValueError):
    return False
  return (step < _FIRST_SPECIAL_STEP and tasks > 1
          and "SLURM_PROCID" in environ)


def port_base(job_id: int, step_id: int) -> int:
  """The port of a step's first task on each node; a node's k-th task
  listens on base + k.

  Steps 0 to 3 of a job, and any two jobs whose IDs are less than 399
  apart, get disjoint blocks of `BLOCK` ports, so jobs sharing a node do
  not collide (with up to 8 tasks of a step on a node).
  """
  blocks = len(PORTS) // BLOCK
  block = (job_id * _STEPS_PER_JOB + step_id % _STEPS_PER_JOB) % blocks
  return PORTS.start + block * BLOCK


_resolved: Dict[Tuple[Tuple[str, str], ...],
                Tuple[Dict[str, List[str]], str, int]] = {}


def resolve() -> Tuple[Dict[str, List[str]], str, int]:
  """This task's step as (cluster spec, task type, task index): one worker
  per task, task rank r is worker r, ports from `port_base`.

  On a node with GPUs the resolver also gives each task its own GPUs
  (CUDA_VISIBLE_DEVICES). That assignment changes what a second resolution
  would count, so a process resolves its step once.

  Raises:
    UserError: SLURM's variables do not describe a step.
  """
  key = tuple(sorted((k, v) for k, v in os.environ.items()
                     if k.startswith("SLURM_")))
  if key not in _resolved:
    _resolved[key] = _resolve()
  return _resolved[key]


def _resolve() -> Tuple[Dict[str, List[str]], str, int]:
  # TensorFlow, imported here: only a SLURM step needs it.
  from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as resolver_lib  # pylint: disable=g-import-not-at-top
  environ = os.environ
  fix = "start every task with srun, or set TF_CONFIG on each task"
  try:
    base = port_base(int(environ.get("SLURM_JOB_ID", "0")),
                     int(environ["SLURM_STEP_ID"]))
    if _has_gpus(environ):
      resolver = resolver_lib.SlurmClusterResolver(port_base=base)
    else:
      # The resolver pairs each task of a node with a slot of GPUs and
      # places no task without one; on CPU nodes, one slot per task that
      # assigns nothing.
      per_node = max(resolver_lib.expand_tasks_per_node(
          environ["SLURM_STEP_TASKS_PER_NODE"]))
      resolver = resolver_lib.SlurmClusterResolver(
          port_base=base, gpus_per_node=per_node, gpus_per_task=1,
          auto_set_gpu=False)
    spec = resolver.cluster_spec().as_dict()
    task_type, task_index = resolver.get_task_info()
  except (KeyError, ValueError, RuntimeError, OSError) as e:
    raise UserError(f"cannot lay out the cluster of this SLURM step ({e}); "
                    f"{fix}") from None
  if task_type is None:
    raise UserError(f"SLURM_PROCID={environ.get('SLURM_PROCID')} is not a "
                    f"task of this SLURM step ({spec}); {fix}")
  return spec, task_type, task_index


def _has_gpus(environ: Mapping[str, str]) -> bool:
  """Whether the resolver can count GPUs: from CUDA_VISIBLE_DEVICES, or
  from nvidia-smi when that is unset."""
  visible = environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return bool(visible.strip())
  return shutil.which("nvidia-smi") is not None
