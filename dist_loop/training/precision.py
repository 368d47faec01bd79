"""Mixed precision in a custom loop: dtype policies and dynamic loss scaling.

`--precision` picks a Keras dtype policy for the model's layers: compute in
float16 or bfloat16, variables (the master weights) in float32. The loss and
the logits are cast to float32 before the loss is taken.

float16 needs loss scaling: small gradients underflow to zero in float16.
Keras 3's `LossScaleOptimizer` only offers `scale_loss` and unscales inside
its own `apply`, which we cannot call (it would all-reduce a second time; see
optim.py). So the loop does it explicitly:

1. scaled_loss = loss * scale, and the tape differentiates scaled_loss;
2. the *scaled* gradients are all-reduced (they stay representable if the
   all-reduce is compressed to fp16);
3. the reduced gradients are divided by the scale (unscaled) in float32;
4. ok = every reduced gradient is finite. After the all-reduce, ok is the
   same on every replica, so every replica skips the same step;
5. the scale halves on a skipped step, and doubles after `GROWTH_INTERVAL`
   good steps in a row (TensorFlow's and Keras' dynamic loss scale rule).

bfloat16 has float32's exponent range and needs no scaling.
"""

import contextlib
from typing import Optional

import keras
import tensorflow as tf

from dist_loop.runtime import strategy as strategy_lib
from dist_loop.training import optim
from dist_loop.core.config import PRECISIONS  # noqa: F401  (re-exported)

INITIAL_SCALE = 2.0 ** 15
GROWTH_INTERVAL = 2000
FACTOR = 2.0


@contextlib.contextmanager
def policy_scope(precision: str):
  """Layers built inside use the `precision` dtype policy."""
  previous = keras.config.dtype_policy()
  keras.config.set_dtype_policy(precision)
  try:
    yield
  finally:
    keras.config.set_dtype_policy(previous)


def needs_loss_scale(precision: str) -> bool:
  return precision == "mixed_float16"


def make_loss_scale(precision: str) -> Optional["DynamicLossScale"]:
  """The loss scale `precision` needs, or None. Build it where the mode
  keeps its optimizer (its strategy's scope, or its master device)."""
  return DynamicLossScale() if needs_loss_scale(precision) else None


def unscale_and_apply(optimizer, grads, variables,
                      loss_scale: Optional["DynamicLossScale"], scale,
                      recipe: "optim.Recipe", step):
  """The end of a synchronous step (sync and pipeline modes): steps 3-5 above.

  `grads` are reduced and, with loss scaling, multiplied by `scale`, the
  value the step's loss was multiplied by. Unscales them, clips them by
  their global norm (`recipe`), applies them once at the rate of the
  update after `step` if all are finite (else the step is skipped on every
  replica alike), and moves the scale. Returns (ok, means): `grad_norm`,
  the unclipped norm, and the recipe's `clipped_fraction` if it clips.
  """
  if scale is not None:
    grads = [g / scale for g in grads]
  ok = optim.all_finite(grads)
  norm = tf.linalg.global_norm(grads)
  grads, means = recipe.clip(grads, norm)
  optim.apply_reduced(optimizer, grads, variables, ok,
                      learning_rate=recipe.rate(step))
  if loss_scale is not None:
    loss_scale.update(ok)
  return ok, {"grad_norm": norm, **means}


class DynamicLossScale(tf.Module):
  """The loss scale and its good-step counter, as (mirrored) variables.

  Build it under the strategy's scope. `update(ok)` is called in replica
  context with `ok` equal on all replicas, so every copy changes alike.
  """

  def __init__(self, initial_scale: float = INITIAL_SCALE,
               growth_interval: int = GROWTH_INTERVAL):
    super().__init__(name="loss_scale")
    self.growth_interval = growth_interval
    agg = tf.VariableAggregation.ONLY_FIRST_REPLICA
    self.scale = tf.Variable(initial_scale, trainable=False,
                             dtype=tf.float32, name="scale", aggregation=agg)
    self.good_steps = tf.Variable(0, trainable=False, dtype=tf.int64,
                                  name="good_steps", aggregation=agg)

  def update(self, ok: tf.Tensor) -> None:
    """Halves the scale after a non-finite step; doubles it after
    `growth_interval` finite ones. Call in replica context, or in
    cross-replica context (the ps mode, under its update lock)."""
    strategy_lib.cross_replica_call(self._update, ok)

  def _update(self, strategy, ok):
    def scale_fn(scale, good, ok):
      grow = tf.logical_and(ok, good + 1 >= self.growth_interval)
      new = tf.where(ok, tf.where(grow, scale * FACTOR, scale),
                     tf.maximum(scale / FACTOR, 1.0))
      return scale.assign(new)

    def good_fn(good, ok):
      grow = tf.logical_and(ok, good + 1 >= self.growth_interval)
      keep_counting = tf.logical_and(ok, tf.logical_not(grow))
      return good.assign(tf.where(keep_counting, good + 1,
                                  tf.zeros_like(good)))

    # The scale reads the counter before it moves: update the scale first.
    strategy.extended.update(self.scale, scale_fn,
                             args=(self.good_steps, ok), group=False)
    strategy.extended.update(self.good_steps, good_fn, args=(ok,), group=False)
