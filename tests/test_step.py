"""The step core: shares, the one regularisation rule, accumulation, and the
inner loop's bookkeeping (with a scripted step function, no model)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dist_loop import models
from dist_loop import step as step_lib
from dist_loop.models.base import MODELS
from dist_loop.precision import DynamicLossScale
from dist_loop.tasks import TASKS

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


BATCH, FEATURES, CLASSES = 8, 5, 3


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
                           regularization=model.losses, contributors=4)
           for i in range(0, BATCH, 2)]
  for name in task.metric_names:
    np.testing.assert_allclose(sum(p[name] for p in parts), whole[name],
                               rtol=1e-6)


def test_accumulated_gradients_equal_the_full_batch_gradient(setup):
  task, model, x, y = setup
  whole, expected = step_lib.gradients(task, model, x, y,
                                       examples_per_update=BATCH)

  @tf.function  # As in a mode's step: the micro-batch loop is a tf loop.
  def accumulated():
    return step_lib.accumulated_gradients(
        task, model, x, y, chunks=4, examples_per_update=BATCH,
        contributors=4, scale=tf.constant(8.0))

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


# -- run_steps: scripted per-step (loss, ok) values --


def _run_steps(losses, oks, nonfinite="raise", loss_scale=None):
  """Runs every scripted step; the carry is the loss of the last step that
  ran. Returns (means, bad_step, carry, step counter)."""
  step = tf.Variable(0, dtype=tf.int64)
  iterator = iter(tf.data.Dataset.from_tensor_slices(
      (tf.constant(losses, tf.float32), tf.constant(oks))))

  def step_fn(batch):
    loss, ok = batch
    return {"loss": loss, "accuracy": loss / 10}, ok, loss

  @tf.function
  def loop():
    return step_lib.run_steps(
        step_fn, iterator, tf.constant(len(losses), tf.int64), step,
        keys=("loss", "accuracy"), nonfinite=nonfinite,
        loss_scale=loss_scale, carry=tf.constant(-1.0))

  means, bad_step, carry = loop()
  return ({k: float(v) for k, v in means.items()}, int(bad_step),
          float(carry), int(step.numpy()))


def test_run_steps_averages_the_applied_steps():
  means, bad, carry, step = _run_steps([1.0, 2.0, 6.0], [True] * 3)
  assert means == pytest.approx(
      {"loss": 3.0, "accuracy": 0.3, "skipped_steps": 0.0})
  assert (bad, carry, step) == (-1, 6.0, 3)


@pytest.mark.parametrize("loss,ok", [(np.nan, False), (np.nan, True),
                                     (1.0, False)])
def test_run_steps_raise_stops_at_a_non_finite_step(loss, ok):
  means, bad, carry, step = _run_steps([1.0, loss, 3.0], [True, ok, True])
  assert (bad, step) == (2, 2)  # The bad step counts; nothing after it runs.
  assert carry == 1.0  # From the last step that was not bad.
  assert means["loss"] == 1.0 and means["skipped_steps"] == 0


def test_run_steps_skips_a_loss_scale_overflow_but_not_a_nan_loss():
  scale = DynamicLossScale(initial_scale=4.0)
  # Finite loss, non-finite gradients: an overflow, skipped.
  means, bad, carry, step = _run_steps([1.0, 2.0, 3.0], [True, False, True],
                                       loss_scale=scale)
  assert means == pytest.approx({"loss": 2.0, "accuracy": 0.2,
                                 "skipped_steps": 1.0, "loss_scale": 4.0})
  assert (bad, carry, step) == (-1, 3.0, 3)
  # A non-finite loss is not an overflow: it stops the loop.
  _, bad, _, step = _run_steps([1.0, np.nan, 3.0], [True, False, True],
                               loss_scale=scale)
  assert (bad, step) == (2, 2)


def test_run_steps_skip_policy_drops_every_non_finite_step():
  means, bad, carry, step = _run_steps(
      [np.nan, 2.0, np.inf, 4.0], [False, True, True, False],
      nonfinite="skip")
  assert means == pytest.approx(
      {"loss": 2.0, "accuracy": 0.2, "skipped_steps": 3.0})
  assert (bad, carry, step) == (-1, 4.0, 4)
  means, _, _, _ = _run_steps([np.nan], [False], nonfinite="skip")
  assert means == {"loss": 0.0, "accuracy": 0.0, "skipped_steps": 1.0}
