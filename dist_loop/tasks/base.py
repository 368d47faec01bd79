"""What is learned: the loss and the metrics of a batch of predictions.

A task sees logits and labels and returns *sums* over every prediction of
the batch: `loss` in nats, and the numerator of each metric (`accuracy`:
the number of correct predictions). Sums, not means, so that the step core
(`dist_loop/training/step.py`) can turn them into any contributor's share of a
step's mean, and the evaluator into a mean over the whole held-out set, with one
rule. A prediction is one label: an example of a classification task has
one, an example of a language-model task has one per position.
"""

import abc
from typing import Dict

import tensorflow as tf

from dist_loop.core.registry import Registry

TASKS: Registry = Registry("task", "task")


class Task(abc.ABC):
  """The loss and metrics of one kind of learning problem."""

  # The keys of `sums`: the loss first, then the metrics.
  metric_names = ("loss",)

  @abc.abstractmethod
  def sums(self, logits: tf.Tensor, labels: tf.Tensor) -> Dict[str, tf.Tensor]:
    """Float32 sums over every prediction: `loss` (nats) and metric numerators.

    Args:
      logits: float32, labels.shape + [num_classes].
      labels: int, [batch, ...].
    """

  def report(self, means: Dict[str, float]) -> Dict[str, float]:
    """Per-prediction means to the metrics a user reads (adds derived ones,
    such as bits per byte). The default reports the means as they are."""
    return dict(means)

  @staticmethod
  def predictions_per_example(labels) -> int:
    """Labels per example: 1 for a class id, the sequence length for text.

    Args:
      labels: a batch of labels with a static shape beyond the batch: a
        tensor, a numpy array or a `tf.TensorSpec`.
    """
    shape = tf.TensorShape(labels.shape)[1:]
    if not shape.is_fully_defined():
      raise ValueError(f"labels need a static shape, got {labels.shape}")
    return int(shape.num_elements())
