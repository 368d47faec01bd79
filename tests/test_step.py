"""The step core: shares, the one regularisation rule and accumulation.

The loop's bookkeeping (means over applied steps, skips, bad steps, the
divergence guard) is the loop base's, tested in test_loop.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dist_loop import models
from dist_loop.models.base import MODELS
from dist_loop.tasks import TASKS
from dist_loop.training import step as step_lib

# A model with a regulariser: its `model.losses` is a per-update term that
# every contributor must share. The equivalence tests train it too.
REGULARISED_MODEL = "test_l2_mlp"
L2 = 0.05


@MODELS.register(REGULARISED_MODEL)
def l2_mlp(input_shape, num_classes):
  del input_shape
  l2 = keras.regularizers.L2(L2)
  return [keras.layers.Flatten(),
          keras.layers.Dense(8, activation="relu", kernel_regularizer=l2),
          keras.layers.Dense(num_classes, kernel_regularizer=l2)]


BATCH, FEATURES, CLASSES = 12, 5, 3


@pytest.fixture(name="setup")
def _setup():
  keras.utils.set_random_seed(0)
  model = models.build(REGULARISED_MODEL, (FEATURES,), CLASSES)
  rng = np.random.RandomState(0)
  x = rng.randn(BATCH, FEATURES).astype(np.float32)
  y = rng.randint(0, CLASSES, BATCH).astype(np.int32)
  return TASKS.get("classification")(), model, x, y


def test_shares_over_contributors_sum_to_the_single_device_loss(setup):
  task, model, x, y = setup
  logits = model(x)
  whole = step_lib.shares(task, logits, y, examples_per_update=BATCH,
                          regularization=model.losses)
  # The single-device loss: mean cross-entropy plus the penalty, once.
  log_p = tf.nn.log_softmax(logits).numpy()
  penalty = sum(L2 * np.sum(np.square(v)) for v in
                (model.layers[1].kernel, model.layers[2].kernel))
  expected = -log_p[np.arange(BATCH), y].mean() + penalty
  assert penalty > 0.05  # Large enough that counting it 4x would show.
  np.testing.assert_allclose(whole["loss"], expected, rtol=1e-5)
  np.testing.assert_allclose(whole["accuracy"],
                             np.mean(log_p.argmax(-1) == y))

  parts = [step_lib.shares(task, logits[i:i + 2], y[i:i + 2],
                           examples_per_update=BATCH,
                           regularization=model.losses,
                           contributors=BATCH // 2)
           for i in range(0, BATCH, 2)]
  for name in task.metric_names:
    np.testing.assert_allclose(sum(p[name] for p in parts), whole[name],
                               rtol=1e-6)


@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_accumulated_gradients_equal_the_full_batch_gradient(setup, chunks):
  """First and last micro-batch outside the loop, the others (none, one,
  two) inside it."""
  task, model, x, y = setup
  whole, expected = step_lib.gradients(task, model, x, y,
                                       examples_per_update=BATCH)

  @tf.function(autograph=False)  # Traced, as in a mode's step.
  def accumulated():
    return step_lib.accumulated_gradients(
        task, model, x, y, chunks=chunks, examples_per_update=BATCH,
        contributors=chunks, scale=tf.constant(8.0))

  out, grads = accumulated()
  for name in task.metric_names:
    np.testing.assert_allclose(out[name], whole[name], rtol=1e-6)
  for g, e in zip(grads, expected):  # Scaled by 8, as float16 asks.
    np.testing.assert_allclose(g, 8.0 * e, rtol=1e-5, atol=1e-7)


def test_a_share_of_a_sequence_task_is_a_mean_over_every_position():
  task = TASKS.get("classification")()
  logits = tf.random.stateless_normal((2, 4, 3), seed=(1, 2))
  labels = tf.constant([[0, 1, 2, 0], [1, 1, 2, 2]])
  out = step_lib.shares(task, logits, labels, examples_per_update=2)
  log_p = tf.nn.log_softmax(logits).numpy()
  expected = -np.take_along_axis(log_p, labels.numpy()[..., None], -1).mean()
  np.testing.assert_allclose(out["loss"], expected, rtol=1e-6)
