"""Classification: softmax cross-entropy and accuracy over class logits.

It takes labels of any rank, so a sequence of next-token labels is a batch
of classifications too (the language-model task builds on it).
"""

from typing import Dict

import keras
import tensorflow as tf

from dist_loop.tasks.base import TASKS, Task


@TASKS.register("classification")
class Classification(Task):
  """Sparse categorical cross-entropy on logits; top-1 accuracy."""

  metric_names = ("loss", "accuracy")

  def sums(self, logits, labels) -> Dict[str, tf.Tensor]:
    logits = tf.cast(logits, tf.float32)
    loss = keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True)
    correct = tf.equal(tf.argmax(logits, -1, output_type=tf.int32),
                       tf.cast(labels, tf.int32))
    return {"loss": tf.reduce_sum(loss),
            "accuracy": tf.reduce_sum(tf.cast(correct, tf.float32))}
