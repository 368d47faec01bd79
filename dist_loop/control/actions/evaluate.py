"""Evaluation on the held-out set every `--eval_every` steps and at the end."""

from typing import Dict, Optional

from absl import logging

from dist_loop.control.actions.base import Action


class Evaluate(Action):
  """The evaluator's metrics (`eval/...`), under the trainer's scope.

  Args:
    every: steps between evaluations.
    evaluator: has `evaluate() -> {"eval/<name>": value}`.
    scope: returns the context under which the master variables are read
      (`Trainer.scope`).
    summaries: `Summaries`.
  """

  at_end = True
  phase = "evaluation"

  def __init__(self, every: int, evaluator, scope, summaries):
    self.every = every
    self._evaluator = evaluator
    self._scope = scope
    self._summaries = summaries
    self.last: Optional[Dict[str, float]] = None  # The latest evaluation.

  def __call__(self, step: int) -> None:
    with self._scope():
      metrics = self._evaluator.evaluate()
    self.last = dict(metrics)
    self._summaries.scalars(step, metrics)
    logging.info("step %d  %s", step, "  ".join(
        f"{k} {v:.4f}" for k, v in metrics.items()))

  def summary(self) -> Dict[str, float]:
    """summary.json's `eval_<name>` entries, of the latest evaluation."""
    return {k.replace("/", "_", 1): v for k, v in (self.last or {}).items()}
