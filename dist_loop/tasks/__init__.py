"""Tasks (a name registry): what a model learns, as loss and metric sums."""

from dist_loop.core.errors import UserError
from dist_loop.runtime import user_code
from dist_loop.tasks import classification, language_model  # Registers the tasks.
from dist_loop.tasks.base import TASKS, Task


def for_dataset(dataset) -> Task:
  """The task a dataset poses (its `task` field names it)."""
  if dataset.task not in TASKS:
    raise UserError(
        f"the dataset poses the task {dataset.task!r}, which is not "
        f"registered (registered: {', '.join(TASKS.names())}); register it "
        f"with @TASKS.register({dataset.task!r}) in dist_loop/tasks")
  task = TASKS.get(dataset.task)()
  user_code.convert_method(task, "sums")  # A user's task: AutoGraph.
  return task


__all__ = ["TASKS", "Task", "for_dataset"]
