"""The Evaluator and probe_gradients against a hand computation on one
Dense layer: held-out means over every prediction (the last partial batch
included, regularisation left out), and the probe's gradient with it."""

import keras
import numpy as np
import pytest

from dist_loop.control.evaluation import Evaluator, probe_gradients
from dist_loop.data import Dataset
from dist_loop.tasks import TASKS

FEATURES, CLASSES = 4, 3
# 7 held-out examples in batches of 3: the last batch holds one.
EXAMPLES, BATCH = 7, 3
L2 = 0.5


def _log_softmax(logits):
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _dense(kernel, bias, input_shape):
  """One Dense layer with these weights and a (large) L2 penalty."""
  model = keras.Sequential([
      keras.Input(input_shape),
      keras.layers.Dense(CLASSES, kernel_regularizer=keras.regularizers.L2(L2))
  ])
  model.layers[0].set_weights([kernel, bias])
  return model


@pytest.fixture(name="case")
def _case():
  rng = np.random.RandomState(0)
  kernel = rng.randn(FEATURES, CLASSES).astype(np.float32)
  bias = rng.randn(CLASSES).astype(np.float32)
  x = rng.randn(EXAMPLES, FEATURES).astype(np.float32)
  y = rng.randint(0, CLASSES, EXAMPLES).astype(np.int32)
  # The last example is one the model gets wrong with a large loss, so a
  # dropped last batch moves both means.
  y[-1] = int(np.argmin(x[-1] @ kernel + bias))
  return kernel, bias, x, y


def _expected(kernel, bias, x, y):
  """(mean loss, accuracy, per-example losses), by hand."""
  logits = x.astype(np.float64) @ kernel + bias
  losses = -np.take_along_axis(_log_softmax(logits), y[..., None], -1)[..., 0]
  correct = logits.argmax(-1) == y
  return losses.mean(), correct.mean(), losses


def test_means_cover_every_example_and_leave_regularisation_out(case):
  kernel, bias, x, y = case
  model = _dense(kernel, bias, (FEATURES,))
  assert float(sum(model.losses)) > 1.0  # A penalty that would show.
  # The training split is not evaluated: make it one that would change
  # every mean.
  dataset = Dataset(np.zeros((5, FEATURES), np.float32),
                    np.zeros(5, np.int32), x, y, CLASSES)
  evaluator = Evaluator(model, dataset, BATCH)
  result = evaluator.evaluate()

  loss, accuracy, losses = _expected(kernel, bias, x, y)
  assert set(result) == {"eval/loss", "eval/accuracy"}
  np.testing.assert_allclose(result["eval/loss"], loss, rtol=1e-5)
  assert result["eval/accuracy"] == pytest.approx(accuracy, abs=1e-6)
  # Had the partial batch been dropped, or the sums divided by whole
  # batches, the mean would be another number.
  assert abs(losses[:6].mean() - loss) > 0.1
  assert abs(losses.sum() / 9 - loss) > 0.1
  # A later evaluation reads the weights as they are then: all zero, every
  # class equally likely.
  model.layers[0].set_weights([kernel * 0, bias * 0])
  again = evaluator.evaluate()
  np.testing.assert_allclose(again["eval/loss"], np.log(CLASSES), rtol=1e-5)


def test_a_sequence_task_averages_over_every_position(case):
  """Language modelling: an example of T positions is T predictions, and
  the task's report adds bits per byte."""
  kernel, bias, _, _ = case
  rng = np.random.RandomState(1)
  steps = 5
  x = rng.randn(EXAMPLES, steps, FEATURES).astype(np.float32)
  y = rng.randint(0, CLASSES, (EXAMPLES, steps)).astype(np.int32)
  model = _dense(kernel, bias, (steps, FEATURES))
  dataset = Dataset(x, y, x, y, CLASSES, task="language_model")
  result = Evaluator(model, dataset, BATCH).evaluate()

  loss, accuracy, _ = _expected(kernel, bias, x.reshape(-1, FEATURES),
                                y.reshape(-1))
  np.testing.assert_allclose(result["eval/loss"], loss, rtol=1e-5)
  assert result["eval/accuracy"] == pytest.approx(accuracy, abs=1e-6)
  np.testing.assert_allclose(result["eval/bits_per_byte"], loss / np.log(2),
                             rtol=1e-5)


def test_probe_gradients_are_of_the_training_loss_with_its_penalty(case):
  kernel, bias, x, y = case
  model = _dense(kernel, bias, (FEATURES,))
  grads = probe_gradients(TASKS.get("classification")(), model, x, y)

  logits = x.astype(np.float64) @ kernel + bias
  d_logits = np.exp(_log_softmax(logits))
  d_logits[np.arange(EXAMPLES), y] -= 1
  d_logits /= EXAMPLES
  # Keras' L2(l) adds l * sum(w^2) to the loss.
  expected = [x.T @ d_logits + 2 * L2 * kernel, d_logits.sum(0)]
  assert len(grads) == 2
  for got, want in zip(grads, expected):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6)
  # The probe changed no weight.
  np.testing.assert_array_equal(model.layers[0].get_weights()[0], kernel)
