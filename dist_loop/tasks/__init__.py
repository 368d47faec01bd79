"""Tasks (a name registry): what a model learns, as loss and metric sums."""

from dist_loop.tasks import classification  # Registers the tasks.
from dist_loop.tasks.base import TASKS, Task


def for_dataset(dataset) -> Task:
  """The task a dataset poses (its `task` field names it)."""
  return TASKS.get(dataset.task)()


__all__ = ["TASKS", "Task", "for_dataset"]
