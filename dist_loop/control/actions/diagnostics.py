"""What TensorBoard shows besides scalars: the graph of the first inner loop,
a profile of chosen steps, and weight and gradient histograms."""

from typing import Callable, Optional, Tuple

import numpy as np

from dist_loop.control.actions.base import Action


class Histograms(Action):
  """Weights, and the full-batch gradient of a fixed probe batch of training
  examples: mode-independent, and it consumes no training input.

  Args:
    every: steps between histograms.
    model: the model holding the master variables.
    batch: the probe batch (x, y).
    gradients: `gradients(model, x, y)` -> one gradient per trainable
      variable, computed where the master variables can be differentiated
      (`Trainer.on_master`).
    summaries: `Summaries`.
  """

  def __init__(self, every: int, model, batch: Tuple[np.ndarray, np.ndarray],
               gradients: Callable, summaries):
    self.every = every
    self._model = model
    self._batch = batch
    self._gradients = gradients
    self._summaries = summaries

  def __call__(self, step: int) -> None:
    grads = self._gradients(self._model, *self._batch)
    values = {}
    for var, grad in zip(self._model.trainable_variables, grads):
      values[f"weights/{var.path}"] = np.asarray(var)
      values[f"gradients/{var.path}"] = np.asarray(grad)
    self._summaries.histograms(step, values)


class Profile(Action):
  """A TF profiler trace of exactly steps `first`..`last`: it starts after
  the loop that reaches `first - 1` and stops after the one reaching `last`."""

  def __init__(self, first: int, last: int, summaries):
    self._begin, self._end = first - 1, last
    self._summaries = summaries

  def stops(self, step: int) -> Optional[int]:
    later = [s for s in (self._begin, self._end) if s > step]
    return min(later) if later else None

  def due(self, step: int) -> bool:
    return step in (self._begin, self._end)

  def start(self, step: int) -> None:
    if step == self._begin:
      self._summaries.profile_begin()

  def __call__(self, step: int) -> None:
    if step == self._begin:
      self._summaries.profile_begin()
    else:
      self._summaries.profile_end()


class TraceGraph(Action):
  """The graph of the first inner loop, for TensorBoard's Graphs tab."""

  def __init__(self, summaries):
    self._summaries = summaries
    self._tracing = False

  def start(self, step: int) -> None:
    self._summaries.trace_begin()
    self._tracing = True

  def due(self, step: int) -> bool:
    return self._tracing

  def __call__(self, step: int) -> None:
    self._summaries.trace_end(step)
    self._tracing = False
