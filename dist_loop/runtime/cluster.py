"""Where this process sits in a TensorFlow cluster: `TF_CONFIG` or a SLURM
step, read once.

TensorFlow's distributed runtime describes a cluster with the `TF_CONFIG`
environment variable, the same on every host except for `task`:

    {"cluster": {"worker": ["host0:2222", "host1:2222"]},
     "task": {"type": "worker", "index": 0}}

The same train command then runs unchanged on one process (no `TF_CONFIG`),
on several local processes (`python -m tools.launch` writes one per task) and
on several hosts. Under SLURM, `srun python -m experiments.train ...` needs
no `TF_CONFIG`: a step of several tasks is a cluster of workers
(`dist_loop/runtime/slurm.py`). This module only builds
the `Cluster`; the modes decide what it means (several workers make
`--mode=sync` multi-worker, `ps` tasks are what `--mode=ps` needs).
`current()` reads the environment: only the entry points call it
(`train.run`, the flag layer), once, and pass the `Cluster` down.
"""

import dataclasses
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

from dist_loop.core.errors import UserError
from dist_loop.runtime import slurm

CHIEF, WORKER, PS, EVALUATOR = "chief", "worker", "ps", "evaluator"

# What a TF_CONFIG error shows as the shape to write.
EXAMPLE = ('{"cluster": {"worker": ["host0:2222", "host1:2222"]}, '
           '"task": {"type": "worker", "index": 0}}')
# Keys TensorFlow reads from TF_CONFIG; any other is a typo that would
# silently make the process a cluster of one.
_TOP_KEYS = ("cluster", "task", "environment", "rpc_layer")
_TASK_KEYS = ("type", "index", "trial")


class ClusterError(UserError):
  """Another task of the cluster failed or became unreachable; the message
  names it and how to resume."""


@dataclasses.dataclass(frozen=True)
class Cluster:
  """The cluster spec and this process's task in it.

  Attributes:
    spec: job name -> list of "host:port"; empty without a cluster.
    task_type: "chief", "worker" or "ps"; None without a cluster.
    task_index: this task's index in its job.
  """

  spec: Mapping[str, List[str]] = dataclasses.field(default_factory=dict)
  task_type: Optional[str] = None
  task_index: int = 0

  @property
  def num_workers(self) -> int:
    return len(self.spec.get(WORKER, ()))

  @property
  def num_ps(self) -> int:
    return len(self.spec.get(PS, ()))

  @property
  def num_tasks(self) -> int:
    return sum(len(addresses) for addresses in self.spec.values())

  @property
  def num_trainers(self) -> int:
    """Processes that run the training loop in a cluster without parameter
    servers (multi-worker sync): the chief, if any, and every worker."""
    return len(self.spec.get(CHIEF, ())) + self.num_workers

  @property
  def is_chief(self) -> bool:
    """The chief task, or worker 0 when there is no chief; True alone."""
    if self.task_type is None or self.task_type == CHIEF:
      return True
    return (self.task_type == WORKER and self.task_index == 0
            and CHIEF not in self.spec)

  @property
  def task_name(self) -> str:
    return f"{self.task_type or 'local'}:{self.task_index}"

  def tasks(self) -> List[Tuple[str, str]]:
    """Every task of the cluster as ("job:index", "host:port")."""
    return [(f"{job}:{i}", address) for job, addresses in self.spec.items()
            for i, address in enumerate(addresses)]

  def as_dict(self) -> Dict[str, List[str]]:
    return {job: list(addresses) for job, addresses in self.spec.items()}


def parse(tf_config: Optional[str]) -> Cluster:
  """Parses a `TF_CONFIG` value (None or "" means a single process).

  Raises:
    UserError: the value is not JSON of TF_CONFIG's shape (an object with a
      "cluster" of jobs, each a list of "host:port", and a "task" naming one
      of them), or has an evaluator task (TensorFlow hangs with an evaluator
      in the workers' cluster spec, tensorflow#46169; the chief evaluates).
      The message shows the shape to write.
  """
  if not tf_config:
    return Cluster()
  try:
    value = json.loads(tf_config)
  except json.JSONDecodeError as e:
    raise _bad(f"is not valid JSON ({e}): {_short(tf_config)}") from None
  if not isinstance(value, dict):
    raise _bad(f"is {_kind(value)}, not a JSON object")
  unknown = sorted(set(value) - set(_TOP_KEYS))
  if unknown:
    raise _bad(f"has unknown keys {unknown} (TensorFlow reads "
               f"{', '.join(_TOP_KEYS)})")
  spec = _spec(value.get("cluster"))
  if not spec:
    return Cluster()
  task_type, task_index = _task(value.get("task"), spec)
  return Cluster(spec, task_type, task_index)


def _spec(cluster: Any) -> Dict[str, List[str]]:
  """TF_CONFIG's "cluster": job -> list of distinct "host:port"."""
  if cluster is None:
    return {}
  if not isinstance(cluster, dict):
    raise _bad(f'has a "cluster" that is {_kind(cluster)}; it maps each job '
               'to its list of "host:port" addresses')
  if EVALUATOR in cluster:
    raise UserError("TF_CONFIG has an 'evaluator' task; remove it (TensorFlow "
                    "hangs with an evaluator in the cluster spec, "
                    "tensorflow#46169): the chief evaluates")
  unknown = sorted(set(cluster) - {CHIEF, WORKER, PS})
  if unknown:
    raise UserError(f"TF_CONFIG has unknown jobs {unknown}; use chief, "
                    "worker and ps")
  seen = {}
  for job, addresses in cluster.items():
    if isinstance(addresses, str):
      raise _bad(f'lists job "{job}" as the string {addresses!r}; write a '
                 f'list: "{job}": [{json.dumps(addresses)}]')
    if not isinstance(addresses, list) or not addresses:
      raise _bad(f'lists job "{job}" as {_kind(addresses)}; write a '
                 'non-empty list of "host:port" addresses')
    for i, address in enumerate(addresses):
      if not _is_address(address):
        raise _bad(f'gives {job}:{i} the address {address!r}; write '
                   '"host:port", with a port from 1 to 65535')
      if address in seen:
        raise _bad(f"gives {seen[address]} and {job}:{i} the same address "
                   f"{address}; give each task its own port")
      seen[address] = f"{job}:{i}"
  return {job: list(addresses) for job, addresses in cluster.items()}


def _task(task: Any, spec: Dict[str, List[str]]) -> Tuple[str, int]:
  """TF_CONFIG's "task": this process's (job, index) in `spec`."""
  jobs = ", ".join(spec)
  if task is None:
    raise _bad('has a "cluster" but no "task"; add "task": {"type": '
               f'"{next(iter(spec))}", "index": N}} naming this process')
  if not isinstance(task, dict):
    raise _bad(f'has a "task" that is {_kind(task)}; write "task": '
               '{"type": JOB, "index": N}')
  unknown = sorted(set(task) - set(_TASK_KEYS))
  if unknown:
    raise _bad(f'has unknown keys {unknown} in "task"; it has "type" and '
               '"index"')
  task_type, task_index = task.get("type"), task.get("index", 0)
  if not isinstance(task_type, str) or task_type not in spec:
    raise UserError(f"TF_CONFIG's task type {task_type!r} is not a job of "
                    f"its cluster ({jobs}); name one of them")
  if not isinstance(task_index, int) or isinstance(task_index, bool):
    raise _bad(f'has the task index {task_index!r}; write an integer, as '
               'in "index": 0')
  if not 0 <= task_index < len(spec[task_type]):
    raise UserError(f"TF_CONFIG's task {task_type}:{task_index} is not in "
                    f"its cluster: job {task_type} has "
                    f"{len(spec[task_type])} task(s), index 0 to "
                    f"{len(spec[task_type]) - 1}")
  return task_type, task_index


def _is_address(address: Any) -> bool:
  if not isinstance(address, str):
    return False
  host, _, port = address.rpartition(":")
  return (bool(host) and port.isascii() and port.isdigit()
          and 1 <= int(port) <= 65535)


def _bad(problem: str) -> UserError:
  return UserError(f"TF_CONFIG {problem}. Its shape: {EXAMPLE}")


def _kind(value: Any) -> str:
  """How a JSON value reads in an error message."""
  if isinstance(value, dict):
    return "an object"
  if isinstance(value, list):
    return "a list" if value else "an empty list"
  if isinstance(value, str):
    return f"the string {_short(value)}"
  if value is None:
    return "null"
  if isinstance(value, bool):
    return json.dumps(value)
  return f"the number {value!r}"


def _short(text: str, limit: int = 80) -> str:
  return repr(text if len(text) <= limit else text[:limit] + "...")


def current() -> Cluster:
  """This process's cluster: from `TF_CONFIG` if it is set, else from a
  SLURM step of several tasks (`dist_loop/runtime/slurm.py`), else a single
  process.

  For the entry points only; everything below them takes a `Cluster`.
  """
  tf_config = os.environ.get("TF_CONFIG")
  if tf_config:
    return parse(tf_config)
  if slurm.in_step(os.environ):
    return Cluster(*slurm.resolve())
  return Cluster()


def describe(error: Exception, limit: int = 300) -> str:
  """A one-line summary of a TensorFlow runtime error, for ClusterError."""
  message = getattr(error, "message", None) or str(error)
  lines = [line.strip() for line in message.splitlines() if line.strip()]
  noise = ("Graph execution error", "Detected at node", "File ", "[[{{")
  lines = [line for line in lines if not line.startswith(noise)]
  return f"{type(error).__name__}: {' '.join(lines)[:limit]}"
