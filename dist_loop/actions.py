"""Actions: the host work the controller schedules between inner loops.

An action runs after the inner loop that reaches each multiple of its
`every` (and, if `at_end`, at the last step). It is called with the step and
may return metrics (`eval/loss`, ...), which the controller keeps for
summary.json. The controller stops each inner loop at the next step any
action asks for (`stops`), so events land on exact steps. After every inner
loop, each action also sees what happened in it (`observe`), so the log line
can average the metrics since the last one.

`standard(...)` is the list a run uses: graph trace, profile, log line,
histograms, evaluation, checkpoint, in that order.
"""

import dataclasses
import datetime
import functools
from typing import Dict, List, Mapping, Optional

import numpy as np
import tensorflow as tf
from absl import logging

from dist_loop.evaluation import probe_gradients
from dist_loop.memory import peak_memory_mb
from dist_loop.modes.base import Reporting

PROBE_BATCH = 256


@dataclasses.dataclass(frozen=True)
class Loop:
  """One inner loop, as the controller saw it.

  `metrics` are `train(n)`'s means without `train/skipped_steps`; `skipped`
  counts the steps of the loop that advanced the counter without applying
  their update.
  """

  start: int
  end: int
  metrics: Mapping[str, float]
  skipped: int
  examples: int
  seconds: float

  @property
  def steps(self) -> int:
    return self.end - self.start

  @property
  def updates(self) -> int:
    """Applied updates: the definition of every `updates_per_sec`."""
    return self.steps - self.skipped


class Action:
  """Something the controller does at steps of its schedule.

  Attributes:
    every: runs after the loop that reaches each multiple of it (0: never
      by this rule).
    at_end: also runs at the last step, and once at the end of a run that
      had nothing to train.
  """

  every: int = 0
  at_end: bool = False

  def stops(self, step: int) -> Optional[int]:
    """The next step after `step` where the inner loop must stop for this
    action, or None."""
    return (step // self.every + 1) * self.every if self.every else None

  def due(self, step: int) -> bool:
    """Whether to run after the loop that reached `step`."""
    return bool(self.every) and step % self.every == 0

  def start(self, step: int) -> None:
    """Before the first inner loop of the run, at `step`."""

  def observe(self, loop: Loop) -> None:
    """After every inner loop, before any action runs."""

  def __call__(self, step: int) -> Optional[Mapping[str, float]]:
    raise NotImplementedError


class Log(Action):
  """The progress line and the train scalars: step-weighted means of the
  train metrics since the last line, the rates, the learning rate, memory
  and the mode's `Reporting`."""

  at_end = True

  def __init__(self, every: int, train_steps: int, trainer, summaries,
               tokens_per_example: int = 1):
    self.every = every
    self._train_steps = train_steps
    self._trainer = trainer
    self._summaries = summaries
    self._skipped_total = 0
    # Predictions per example: a language model reports tokens per second.
    self._tokens_per_example = tokens_per_example
    self._reset()

  def _reset(self):
    self._sums: Dict[str, float] = {}
    self._steps = self._updates = self._examples = 0
    self._seconds = 0.0

  def observe(self, loop: Loop) -> None:
    for k, v in loop.metrics.items():
      self._sums[k] = self._sums.get(k, 0.0) + v * loop.steps
    self._steps += loop.steps
    self._updates += loop.updates
    self._examples += loop.examples
    self._seconds += loop.seconds
    self._skipped_total += loop.skipped

  def __call__(self, step: int) -> Optional[Dict[str, float]]:
    if not self._steps:
      return None  # Nothing trained since the last line.
    means = {k: v / self._steps for k, v in self._sums.items()}
    seconds = max(self._seconds, 1e-9)
    rates = {"train/examples_per_sec": self._examples / seconds,
             "train/steps_per_sec": self._steps / seconds,
             "train/updates_per_sec": self._updates / seconds}
    if self._tokens_per_example > 1:
      rates["train/tokens_per_sec"] = (rates["train/examples_per_sec"]
                                       * self._tokens_per_example)
    learning_rate = float(tf.convert_to_tensor(
        self._trainer.optimizer.learning_rate))
    self._reset()
    self._summaries.scalars(step, {
        **means, **rates, "train/learning_rate": learning_rate,
        "nonfinite/skipped_steps": self._skipped_total,
        **peak_memory_mb(self._trainer.devices)})
    if isinstance(self._trainer, Reporting):
      report = self._trainer.report()
      self._summaries.scalars(step, report.scalars)
      self._summaries.histograms(step, report.histograms)
      self._summaries.images(step, report.images)
    remaining = self._train_steps - step
    eta = datetime.timedelta(seconds=int(
        remaining / max(rates["train/steps_per_sec"], 1e-9)))
    throughput = (f"{rates['train/tokens_per_sec']:.0f} tok/s"
                  if "train/tokens_per_sec" in rates
                  else f"{rates['train/examples_per_sec']:.0f} ex/s")
    logging.info("step %d/%d  loss %.4f  acc %.3f  %s  eta %s", step,
                 self._train_steps, means.get("train/loss", np.nan),
                 means.get("train/accuracy", np.nan), throughput, eta)
    return means


class Evaluate(Action):
  """The evaluator's metrics (`eval/...`), under the trainer's scope."""

  at_end = True

  def __init__(self, every: int, evaluator, scope, summaries):
    self.every = every
    self._evaluator = evaluator
    self._scope = scope
    self._summaries = summaries

  def __call__(self, step: int) -> Dict[str, float]:
    with self._scope():
      metrics = self._evaluator.evaluate()
    self._summaries.scalars(step, metrics)
    logging.info("step %d  %s", step, "  ".join(
        f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


class Checkpoint(Action):
  """A checkpoint (`checkpoints.Checkpointer.save`)."""

  at_end = True

  def __init__(self, every: int, checkpointer):
    self.every = every
    self._checkpointer = checkpointer

  def __call__(self, step: int) -> None:
    self._checkpointer.save(step)


class Histograms(Action):
  """Weights, and the full-batch gradient of a fixed probe batch of training
  examples: mode-independent, and it consumes no training input."""

  def __init__(self, every: int, trainer, task, summaries):
    self.every = every
    self._trainer = trainer
    self._summaries = summaries
    # One callable for the whole run: `on_master` traces once per callable.
    self._probe = functools.partial(probe_gradients, task)

  def __call__(self, step: int) -> None:
    model, dataset = self._trainer.model, self._trainer.dataset
    x = dataset.train_x[:PROBE_BATCH]
    y = dataset.train_y[:PROBE_BATCH]
    grads = self._trainer.on_master(self._probe, model, x, y)
    values = {}
    for var, grad in zip(model.trainable_variables, grads):
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


def standard(config, trainer, evaluator, checkpointer, summaries,
             task) -> List[Action]:
  """The actions of a run, from its config, in the order they run."""
  out: List[Action] = [TraceGraph(summaries)]
  if config.profile_range:
    out.append(Profile(*config.profile_range, summaries))
  tokens = (1 if task is None
            else task.predictions_per_example(trainer.dataset.train_y))
  out.append(Log(config.log_every, config.train_steps, trainer, summaries,
                 tokens))
  if config.histogram_every:
    out.append(Histograms(config.histogram_every, trainer, task, summaries))
  out.append(Evaluate(config.eval_every, evaluator, trainer.scope, summaries))
  out.append(Checkpoint(config.checkpoint_every, checkpointer))
  return out
