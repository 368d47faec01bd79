"""A SLURM job step as a cluster of workers.

Under SLURM, `srun python -m experiments.train ...` starts one task per
process; those tasks form the cluster without a `TF_CONFIG`. The layout is
TensorFlow's `SlurmClusterResolver`'s, read from the same variables
(SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST,
SLURM_STEP_TASKS_PER_NODE): the nodes in sorted order, each node's tasks in
rank order, task rank r is worker r. It is done here rather than by the
resolver, which fails real GPU steps: it runs `nvidia-smi` with no time
bound, and divides a node's visible GPUs by its tasks, so that the step
SLURM makes of `--gpus-per-task=1` (each task sees its own GPU as
`CUDA_VISIBLE_DEVICES=0`) or a node that lists no GPUs gives it a stride of
zero. Every variable is checked here and named in the error.

GPUs (`_gpus_of_task`): a task that already sees only its own GPUs (SLURM
bound them: `--gpus-per-task`, `--gpu-bind`) keeps them; a task that sees
all of its node's GPUs gets its share, by its place on the node. The ports
are ours (`port_base`): the resolver's default, 8888 for every job,
collides when two jobs share a node.
"""

import os
import re
import shutil
import signal
import subprocess
from typing import Dict, List, Mapping, Optional, Tuple

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
# nvidia-smi answers in well under a second; one that hangs (a wedged
# driver) must not hang the start.
NVIDIA_SMI_TIMEOUT_S = 15.0
# A host name (RFC 1123 labels; underscores, which some sites use, too).
_HOST = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_FIX = "start every task with srun, or set TF_CONFIG on each task"


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

  On a node with GPUs this task is also given its own GPUs
  (CUDA_VISIBLE_DEVICES). That assignment changes what a second resolution
  would count, so a process resolves its step once.

  Raises:
    UserError: SLURM's variables do not describe a step (naming the
      variable), or nvidia-smi fails or does not answer in time.
  """
  key = tuple(sorted((k, v) for k, v in os.environ.items()
                     if k.startswith("SLURM_")))
  if key not in _resolved:
    _resolved[key] = _resolve(os.environ)
  return _resolved[key]


def _resolve(environ) -> Tuple[Dict[str, List[str]], str, int]:
  base = port_base(_number(environ, "SLURM_JOB_ID", "0"),
                   _number(environ, "SLURM_STEP_ID"))
  rank = _number(environ, "SLURM_PROCID")
  num_tasks = _number(environ, "SLURM_STEP_NUM_TASKS")
  hosts = expand_hostlist(_variable(environ, "SLURM_STEP_NODELIST"))
  per_node_text = _variable(environ, "SLURM_STEP_TASKS_PER_NODE")
  counts = expand_tasks_per_node(per_node_text)
  per_node = f"SLURM_STEP_TASKS_PER_NODE={per_node_text!r}"
  if len(counts) != len(hosts):
    raise _bad(f"{per_node} gives {len(counts)} nodes, but "
               f"SLURM_STEP_NODELIST lists {len(hosts)}")
  if sum(counts) != num_tasks:
    raise _bad(f"SLURM_STEP_NUM_TASKS={num_tasks}, but {per_node} places "
               f"{sum(counts)} tasks")
  if not 0 <= rank < num_tasks:
    raise _bad(f"SLURM_PROCID={rank} is not a task of this SLURM step of "
               f"{num_tasks} tasks")
  workers, place = [], None
  for host, count in sorted(zip(hosts, counts)):
    for local in range(count):
      if len(workers) == rank:
        place = (local, count)
      workers.append(f"{host}:{base + local}")
  gpus = _gpus_of_task(environ, *place)
  if gpus is not None:
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus
  return {"worker": workers}, "worker", rank


def _variable(environ, name: str) -> str:
  if name not in environ:
    raise _bad(f"{name} is not set")
  return environ[name]


def _number(environ, name: str, default: Optional[str] = None) -> int:
  """A SLURM variable that holds a count or an ID, named if it does not."""
  text = environ.get(name, default)
  if text is None:
    raise _bad(f"{name} is not set")
  if not text.strip().isdigit():
    raise _bad(f"{name}={text!r} is not a number")
  return int(text)


def _bad(problem: str) -> UserError:
  return UserError(f"cannot lay out the cluster of this SLURM step: "
                   f"{problem}; {_FIX}")


def expand_hostlist(hostlist: str) -> List[str]:
  """SLURM's compact host list ("node[01-03,07],gpu5") as host names.

  Raises:
    UserError: naming the list and the part that is not a host name.
  """
  # Split on the commas outside brackets.
  parts, depth, start = [], 0, 0
  for i, char in enumerate(hostlist + ","):
    depth += {"[": 1, "]": -1}.get(char, 0)
    if depth < 0 or depth > 1:
      break
    if char == "," and depth == 0:
      parts.append(hostlist[start:i])
      start = i + 1
  if depth != 0 or not all(parts):
    raise _bad(f"SLURM_STEP_NODELIST={hostlist!r} is not a host list")
  hosts = []
  for part in parts:
    for host in _expand_brackets(part, hostlist):
      if not _HOST.match(host):
        raise _bad(f"SLURM_STEP_NODELIST={hostlist!r} has {host!r}, which is "
                   "not a host name")
      hosts.append(host)
  return hosts


def _expand_brackets(part: str, hostlist: str) -> List[str]:
  match = re.match(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$", part)
  if not match:
    return [part]
  prefix, ranges, rest = match.groups()
  out = []
  for item in ranges.split(","):
    low, _, high = item.partition("-")
    if not low.isdigit() or not (high or low).isdigit() or int(
        high or low) < int(low):
      raise _bad(f"SLURM_STEP_NODELIST={hostlist!r} has the range [{ranges}]")
    for n in range(int(low), int(high or low) + 1):
      out += [f"{prefix}{n:0{len(low)}d}{tail}"
              for tail in _expand_brackets(rest, hostlist)]
  return out


def expand_tasks_per_node(text: str) -> List[int]:
  """SLURM's "2(x3),1" as [2, 2, 2, 1].

  Raises:
    UserError: naming the variable.
  """
  out = []
  for item in text.split(","):
    match = re.match(r"^(\d+)(?:\(x(\d+)\))?$", item.strip())
    if not match or int(match.group(1)) < 1:
      raise _bad(f"SLURM_STEP_TASKS_PER_NODE={text!r} is not a list of task "
                 "counts like 2(x3),1")
    out += [int(match.group(1))] * int(match.group(2) or 1)
  return out


def _gpus_of_task(environ, local: int, local_tasks: int) -> Optional[str]:
  """CUDA_VISIBLE_DEVICES for this task, the `local`-th of `local_tasks` on
  its node; None to leave it as it is (no GPUs, or only its own).

  A task sees the GPUs in CUDA_VISIBLE_DEVICES, else those nvidia-smi
  lists. Each task takes SLURM_GPUS_PER_TASK of them if set, else an equal
  share of the node's: a task that sees no more than that sees its own.
  """
  visible = environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    ids = [i.strip() for i in visible.split(",") if i.strip()]
  else:
    ids = [str(i) for i in range(_count_gpus())]
  if not ids:
    return None
  per_task = environ.get("SLURM_GPUS_PER_TASK")
  if per_task is not None:
    count = per_task.rpartition(":")[2]  # "[type:]count"
    if not count.isdigit() or int(count) < 1:
      raise _bad(f"SLURM_GPUS_PER_TASK={per_task!r} is not a GPU count")
    per_task = int(count)
  else:
    per_task = max(1, len(ids) // local_tasks)
  if len(ids) <= per_task:
    return None  # Its own, as SLURM bound them.
  if len(ids) < per_task * local_tasks:
    raise _bad(f"this task sees {len(ids)} GPUs ({','.join(ids)}), fewer "
               f"than its node's {local_tasks} tasks of {per_task} GPUs each")
  return ",".join(ids[local * per_task:(local + 1) * per_task])


def _count_gpus() -> int:
  """The GPUs `nvidia-smi --list-gpus` lists; 0 without nvidia-smi.

  Raises:
    UserError: it failed, or did not answer in NVIDIA_SMI_TIMEOUT_S.
  """
  if shutil.which("nvidia-smi") is None:
    return 0
  fix = ("fix the node's GPU driver, or set CUDA_VISIBLE_DEVICES to this "
         "task's GPUs (empty: none)")
  # Its own session, so that a timeout ends whatever it started too (a
  # wrapper script's children would hold its output open).
  process = subprocess.Popen(["nvidia-smi", "--list-gpus"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, text=True,
                             start_new_session=True)
  try:
    output, _ = process.communicate(timeout=NVIDIA_SMI_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    try:
      os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    process.wait()
    raise UserError(f"nvidia-smi --list-gpus did not answer in "
                    f"{NVIDIA_SMI_TIMEOUT_S:g} s; {fix}") from None
  if process.returncode:
    last = (output.strip().splitlines() or ["no output"])[-1][:200]
    raise UserError(f"nvidia-smi --list-gpus failed (exit code "
                    f"{process.returncode}: {last}); {fix}")
  return sum(line.startswith("GPU ") for line in output.splitlines())
