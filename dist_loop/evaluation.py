"""Evaluation on the held-out split, from the master variables.

Evaluation runs on the first device, outside `strategy.run`: reading a
mirrored variable in cross-replica context gives the first replica's copy,
which equals the others after every synchronous step. Other modes hand in
their master model the same way. The split is small, so one device is enough.
"""

from typing import Dict

import keras
import tensorflow as tf

from dist_loop.data import Dataset, eval_dataset


class Evaluator:
  """Mean loss and accuracy over the whole eval split."""

  def __init__(self, model: keras.Model, split: Dataset, batch_size: int):
    self._model = model
    self._dataset = eval_dataset(split.eval_x, split.eval_y, batch_size)
    self._num_examples = len(split.eval_y)
    self._run = tf.function(self._run_fn)

  def _run_fn(self):
    loss_sum = tf.constant(0.0)
    correct = tf.constant(0.0)
    for x, y in self._dataset:
      logits = tf.cast(self._model(x, training=False), tf.float32)
      loss_sum += tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(
          y, logits, from_logits=True))
      correct += tf.reduce_sum(tf.cast(
          tf.equal(tf.argmax(logits, -1, output_type=tf.int32),
                   tf.cast(y, tf.int32)), tf.float32))
    return loss_sum, correct

  def evaluate(self) -> Dict[str, float]:
    loss_sum, correct = self._run()
    n = float(self._num_examples)
    return {"eval/loss": float(loss_sum) / n,
            "eval/accuracy": float(correct) / n}


def probe_gradients(model: keras.Model, x, y):
  """Full-batch gradient of the mean loss on (x, y) at the current weights.

  Used for gradient histograms: mode-independent, and it does not consume
  training input or touch the optimizer.
  """
  with tf.GradientTape() as tape:
    logits = model(x, training=False)
    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        y, logits, from_logits=True))
  return tape.gradient(loss, model.trainable_variables)
