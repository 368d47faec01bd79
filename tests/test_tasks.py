"""Tasks: the sums of the loss and the metrics, and which task a dataset
poses."""

import numpy as np
import pytest
import tensorflow as tf

from dist_loop import tasks
from dist_loop.core.errors import UserError
from dist_loop.data import Dataset
from dist_loop.tasks.classification import Classification


def test_classification_sums_cross_entropy_and_correct_predictions():
  logits = np.array([[2.0, 0.0, -1.0], [0.0, 3.0, 0.0], [1.0, 0.0, 4.0],
                     [0.5, 0.2, 0.1]], np.float32)
  labels = np.array([0, 2, 2, 1], np.int32)
  log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  # float16 logits (mixed precision) are summed in float32.
  sums = Classification().sums(tf.constant(logits, tf.float16), labels)
  assert sums["loss"].dtype == tf.float32
  np.testing.assert_allclose(sums["loss"], -log_p[np.arange(4), labels].sum(),
                             rtol=1e-3)
  assert float(sums["accuracy"]) == 2.0  # Rows 0 and 2.
  assert set(sums) == set(Classification.metric_names)


def test_labels_of_any_rank_are_predictions():
  task = Classification()
  logits = tf.zeros((2, 5, 4))  # Uniform: each prediction costs log(4).
  labels = tf.zeros((2, 5), tf.int32)
  np.testing.assert_allclose(task.sums(logits, labels)["loss"],
                             10 * np.log(4.0), rtol=1e-6)
  assert task.predictions_per_example(labels) == 5
  assert task.predictions_per_example(np.zeros((7, 3, 2))) == 6
  assert task.predictions_per_example(
      tf.TensorSpec([None], tf.int32)) == 1  # Batches of unknown size.
  with pytest.raises(ValueError, match="static shape"):
    task.predictions_per_example(tf.TensorSpec([None, None], tf.int32))


def test_report_passes_the_means_through():
  means = {"loss": 0.5, "accuracy": 0.9}
  assert Classification().report(means) == means


def test_a_dataset_names_its_task():
  x, y = np.zeros((4, 2), np.float32), np.zeros(4, np.int32)
  assert isinstance(tasks.for_dataset(Dataset(x, y, x, y, 2)), Classification)
  with pytest.raises(UserError, match="'speech'.*TASKS.register"):
    tasks.for_dataset(Dataset(x, y, x, y, 2, task="speech"))
