"""Evaluation on the held-out set, from the master variables.

Evaluation runs on the first device, outside `strategy.run`: reading a
mirrored variable in cross-replica context gives the first replica's copy,
which equals the others after every synchronous step. Other modes hand in
their master model the same way. The set is small, so one device is enough.
The loss and metrics are the task's (`dist_loop/tasks`), as in training,
but without regularisation: they measure the fit to held-out data.
"""

from typing import Dict, Optional

import keras
import tensorflow as tf

from dist_loop import tasks
from dist_loop.data import Dataset, eval_dataset
from dist_loop.tasks import Task
from dist_loop.training import step


class Evaluator:
  """The task's metrics, as means over every prediction of the eval set.

  `task` defaults to the one the dataset poses, as the trainers' does.
  """

  def __init__(self, model: keras.Model, dataset: Dataset, batch_size: int,
               task: Optional[Task] = None):
    if task is None:
      task = tasks.for_dataset(dataset)
    self._model = model
    self._task = task
    self._dataset = eval_dataset(dataset.eval_x, dataset.eval_y, batch_size)
    self._predictions = len(dataset.eval_y) * task.predictions_per_example(
        self._dataset.element_spec[1])
    self._run = tf.function(self._run_fn, autograph=False)

  def _run_fn(self):
    def add(totals, batch):
      x, y = batch
      sums = self._task.sums(self._model(x, training=False), y)
      return {k: totals[k] + sums[k] for k in totals}
    return self._dataset.reduce(
        {k: tf.constant(0.0) for k in self._task.metric_names}, add)

  def evaluate(self) -> Dict[str, float]:
    """`eval/<metric>` for each of the task's metrics."""
    means = {k: float(v) / self._predictions for k, v in self._run().items()}
    return {f"eval/{k}": v for k, v in self._task.report(means).items()}


def probe_gradients(task: Task, model: keras.Model, x, y):
  """Full-batch gradient of the training loss on (x, y) at the current
  weights (regularisation included, as in a step).

  Used for gradient histograms: mode-independent, and it does not consume
  training input or touch the optimizer.
  """
  _, grads = step.gradients(task, model, x, y,
                            examples_per_update=int(y.shape[0]),
                            training=False)
  return grads
