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

import itertools
import math
import os
import re
import shutil
import signal
import subprocess
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

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
# SLURM's IDs and task counts are 32-bit, a host list's numbers 64-bit;
# past these, a variable is not SLURM's (and Python refuses to convert
# numbers of thousands of digits).
_MAX_NUMBER = 2**32 - 1
_MAX_HOST_NUMBER = 2**64 - 1


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
  # Both lists are counted before they are expanded: a compact list can
  # name billions of nodes, and a step has at most one per task.
  hostlist = _variable(environ, "SLURM_STEP_NODELIST")
  num_hosts = count_hostlist(hostlist)
  per_node_text = _variable(environ, "SLURM_STEP_TASKS_PER_NODE")
  runs = _task_runs(per_node_text)
  num_nodes = sum(repeat for _, repeat in runs)
  placed = sum(count * repeat for count, repeat in runs)
  per_node = f"SLURM_STEP_TASKS_PER_NODE={per_node_text!r}"
  if num_nodes != num_hosts:
    raise _bad(f"{per_node} gives {num_nodes} nodes, but "
               f"SLURM_STEP_NODELIST lists {_many(num_hosts)}")
  if placed != num_tasks:
    raise _bad(f"SLURM_STEP_NUM_TASKS={num_tasks}, but {per_node} places "
               f"{placed} tasks")
  if not 0 <= rank < num_tasks:
    raise _bad(f"SLURM_PROCID={rank} is not a task of this SLURM step of "
               f"{num_tasks} tasks")
  # At most `num_tasks` of each now: every node has a task or more.
  hosts = expand_hostlist(hostlist)
  counts = expand_tasks_per_node(per_node_text)
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
  if not text.strip().isdecimal() or len(text.strip()) > 10 or int(
      text) > _MAX_NUMBER:
    raise _bad(f"{name}={text!r} is not a number from 0 to {_MAX_NUMBER}")
  return int(text)


def _bad(problem: str) -> UserError:
  return UserError(f"cannot lay out the cluster of this SLURM step: "
                   f"{problem}; {_FIX}")


def expand_hostlist(hostlist: str) -> List[str]:
  """SLURM's compact host list ("node[01-03,07],gpu5") as host names.

  Raises:
    UserError: naming the list and the part that is not a host name.
  """
  hosts = []
  for part in _hostlist_parts(hostlist):
    for host in _expand_brackets(part, hostlist):
      _check_host(host, hostlist)
      hosts.append(host)
  return hosts


def count_hostlist(hostlist: str) -> int:
  """How many host names SLURM's compact host list has, without listing
  them (`node[0-99999999]` is one line and 10**8 names).

  Raises:
    UserError: as `expand_hostlist` (a bad name: found by its first host;
      a host's numbers are digits, which fit anywhere in a name).
  """
  total = 0
  for part in _hostlist_parts(hostlist):
    _check_host(_first_host(part, hostlist), hostlist)
    total += _count_brackets(part, hostlist)
  return total


def _many(count: int) -> str:
  """`count`, or a bound it is over (Python prints no number of more than
  4300 digits, and a list of 1000 brackets can count more)."""
  return (str(count) if count <= _MAX_HOST_NUMBER
          else f"over {_MAX_HOST_NUMBER}")


def _hostlist_parts(hostlist: str) -> List[str]:
  """The list split on the commas outside brackets."""
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
  return parts


def _check_host(host: str, hostlist: str) -> None:
  if not _HOST.match(host):
    raise _bad(f"SLURM_STEP_NODELIST={hostlist!r} has {host!r}, which is "
               "not a host name")


def _brackets(part: str, hostlist: str):
  """A part as its text between brackets and each bracket's numbers as
  (low, high, digits): "n[1-2,5]x[3]" is ["n", "x", ""] and
  [[(1, 2, 1), (5, 5, 1)], [(3, 3, 1)]]."""
  pieces = re.split(r"\[([^\[\]]*)\]", part)  # Brackets nest in no part.
  numbers = []
  for ranges in pieces[1::2]:
    numbers.append([])
    for item in ranges.split(","):
      low, _, high = item.partition("-")
      if not all(n.isdecimal() and len(n) <= 20 and int(n) <= _MAX_HOST_NUMBER
                 for n in (low, high or low)) or int(high or low) < int(low):
        raise _bad(f"SLURM_STEP_NODELIST={hostlist!r} has the range "
                   f"[{ranges}]")
      numbers[-1].append((int(low), int(high or low), len(low)))
  return pieces[0::2], numbers


def _expand_brackets(part: str, hostlist: str) -> Iterator[str]:
  texts, numbers = _brackets(part, hostlist)
  names = [[f"{n:0{digits}d}" for low, high, digits in ranges
            for n in range(low, high + 1)] for ranges in numbers]
  for combination in itertools.product(*names):
    yield texts[0] + "".join(n + t for n, t in zip(combination, texts[1:]))


def _first_host(part: str, hostlist: str) -> str:
  texts, numbers = _brackets(part, hostlist)
  return texts[0] + "".join(f"{r[0][0]:0{r[0][2]}d}{t}"
                            for r, t in zip(numbers, texts[1:]))


def _count_brackets(part: str, hostlist: str) -> int:
  return math.prod(sum(high - low + 1 for low, high, _ in ranges)
                   for ranges in _brackets(part, hostlist)[1])


def expand_tasks_per_node(text: str) -> List[int]:
  """SLURM's "2(x3),1" as [2, 2, 2, 1].

  Raises:
    UserError: naming the variable.
  """
  return [count for count, repeat in _task_runs(text)
          for _ in range(repeat)]


def _task_runs(text: str) -> List[Tuple[int, int]]:
  """SLURM's "2(x3),1" as (tasks per node, nodes): [(2, 3), (1, 1)].

  Raises:
    UserError: naming the variable.
  """
  out = []
  for item in text.split(","):
    match = re.match(r"^(\d{1,10})(?:\(x(\d{1,10})\))?$", item.strip())
    if (not match or not 1 <= int(match.group(1)) <= _MAX_NUMBER
        or int(match.group(2) or 1) > _MAX_NUMBER):
      raise _bad(f"SLURM_STEP_TASKS_PER_NODE={text!r} is not a list of task "
                 "counts like 2(x3),1")
    out.append((int(match.group(1)), int(match.group(2) or 1)))
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
    if not count.isdecimal() or len(count) > 10 or int(count) < 1:
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
