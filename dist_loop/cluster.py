"""Where this process sits in a TensorFlow cluster: `TF_CONFIG`, parsed once.

TensorFlow's distributed runtime describes a cluster with the `TF_CONFIG`
environment variable, the same on every host except for `task`:

    {"cluster": {"worker": ["host0:2222", "host1:2222"]},
     "task": {"type": "worker", "index": 0}}

The same train command then runs unchanged on one process (no `TF_CONFIG`),
on several local processes (`python -m tools.launch` writes one per task) and
on several hosts. This module only parses it into a `Cluster`; the modes
decide what it means (several workers make `--mode=sync` multi-worker, `ps`
tasks are what `--mode=ps` needs). `current()` reads the environment: only
the entry points call it (`train.run`, the flag layer), once, and pass the
`Cluster` down.
"""

import dataclasses
import json
import os
from typing import Dict, List, Mapping, Optional

from dist_loop.errors import UserError

CHIEF, WORKER, PS, EVALUATOR = "chief", "worker", "ps", "evaluator"


class ClusterError(UserError):
  """Another task of the cluster failed or became unreachable; the message
  names it and how to resume."""


@dataclasses.dataclass(frozen=True)
class Cluster:
  """The cluster spec and this process's task in it.

  Attributes:
    spec: job name -> list of "host:port"; empty without TF_CONFIG.
    task_type: "chief", "worker" or "ps"; None without TF_CONFIG.
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

  def as_dict(self) -> Dict[str, Dict[str, List[str]]]:
    return {job: list(addresses) for job, addresses in self.spec.items()}


def parse(tf_config: Optional[str]) -> Cluster:
  """Parses a `TF_CONFIG` value (None or "" means a single process).

  Raises:
    UserError: the value is not valid JSON, names no task of the cluster, or
      has an evaluator task (TensorFlow hangs with an evaluator in the
      workers' cluster spec, tensorflow#46169; evaluation runs on the chief).
  """
  if not tf_config:
    return Cluster()
  try:
    value = json.loads(tf_config)
  except json.JSONDecodeError as e:
    raise UserError(f"TF_CONFIG is not valid JSON ({e}): {tf_config!r}"
                    ) from None
  spec = value.get("cluster") or {}
  task = value.get("task") or {}
  if not spec:
    return Cluster()
  if EVALUATOR in spec:
    raise UserError("TF_CONFIG has an 'evaluator' task; remove it (TensorFlow "
                    "hangs with an evaluator in the cluster spec, "
                    "tensorflow#46169): the chief evaluates")
  unknown = sorted(set(spec) - {CHIEF, WORKER, PS})
  if unknown:
    raise UserError(f"TF_CONFIG has unknown jobs {unknown}; use chief, "
                    "worker and ps")
  task_type, task_index = task.get("type"), int(task.get("index", 0))
  if task_type not in spec or not 0 <= task_index < len(spec[task_type]):
    raise UserError(f"TF_CONFIG's task {task!r} is not in its cluster "
                    f"{json.dumps(spec)}")
  return Cluster({k: list(v) for k, v in spec.items()}, task_type, task_index)


def current() -> Cluster:
  """This process's cluster, from the `TF_CONFIG` environment variable.

  For the entry points only; everything below them takes a `Cluster`.
  """
  return parse(os.environ.get("TF_CONFIG"))


def describe(error: Exception, limit: int = 300) -> str:
  """A one-line summary of a TensorFlow runtime error, for ClusterError."""
  message = getattr(error, "message", None) or str(error)
  lines = [line.strip() for line in message.splitlines() if line.strip()]
  noise = ("Graph execution error", "Detected at node", "File ", "[[{{")
  lines = [line for line in lines if not line.startswith(noise)]
  return f"{type(error).__name__}: {' '.join(lines)[:limit]}"
