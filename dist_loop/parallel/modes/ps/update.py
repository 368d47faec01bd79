"""The update of --mode=ps: decide and apply a gradient under a lock on a PS.

A worker computes a gradient on weights it read at version v (the value of
`step`, the number of applied updates), then offers it here:

    under the lock (a tf.CriticalSection next to `step`, on a PS):
      tau   = step - v                   exact: only this code moves `step`
      apply = finite, loss <= --max_loss, tau <= --max_staleness, and
              step < the call's target
      1. weights and the optimizer's counter move, if apply
      2. step += apply
      3. the stats vector += this step's record (stats.py)

Why one locked step. Checked outside the lock, two workers could both find
tau within the bound and both apply, the second staler than the bound
allows. Under the lock the bound holds exactly in the order updates are
applied, and `step` (moved only here) counts them exactly; the Keras
optimizer's counter moves with one `assign_add` under the same lock.

Why that write order. A step cut short while it holds the lock (its worker
killed, or a call the coordinator abandons and re-runs) loses its remaining
ops and releases the lock. In this order, at most that one update is left
part-done: weights moved but not `step`, or `step` but not the record.

Why the lock never waits on a worker. Every op under it runs on the PSs,
after the gradients have arrived there, so a worker that dies mid-step
cannot hold it. It is taken in cross-replica context, after `strategy.run`:
inside it, the lock would be held across `merge_call`'s hand-off to the
replica thread, which deadlocks tracing. Only updates are serialised; the
gradients are computed in parallel.

float16: the loss scale is a PS variable that the worker read with v. The
overflow rule of the asynchronous modes (`staleness.overflow`) is applied
here, under the lock, so the scale moves once per decision.

A loss above `--max_loss` (the step core's `above_bound`) is a divergence:
the gradient is not applied and is recorded as `nonfinite`, never as a
float16 overflow to skip, so the trainer stops as for a non-finite step.
"""

from typing import Dict, Mapping, Sequence

import tensorflow as tf

from dist_loop.parallel import staleness
from dist_loop.parallel.modes.ps import stats as stats_lib
from dist_loop.training import optim
from dist_loop.training import step as step_lib


class LockedUpdate:
  """Offers one gradient to the shared variables, under the update lock.

  Call it in a `tf.function`, in cross-replica context. Every variable
  passed in lives on the PSs (or is local, in tests).
  """

  def __init__(self, *, optimizer, variables: Sequence, step: tf.Variable,
               stats: tf.Variable, layout: stats_lib.Layout,
               max_staleness: int, loss_scale=None, max_loss: float = 0.0,
               rate=None):
    """Builds the lock on `step`'s device.

    Args:
      optimizer: the built Keras optimizer of `variables`.
      variables: the model's trainable variables.
      step: the int64 version and step counter.
      stats: the float64 vector of `layout.size` records are added to.
      layout: the vector's layout.
      max_staleness: the bound (`staleness.NO_BOUND`: none).
      loss_scale: the float16 `DynamicLossScale`, or None.
      max_loss: a gradient whose loss is above it is not applied and is
        recorded as non-finite; 0: no bound.
      rate: `fn(step) -> float32` rate of the update after `step`
        (`optim.Recipe.rate`); None: the optimizer's.
    """
    self.optimizer = optimizer
    self.variables = list(variables)
    self.step = step
    self.stats = stats
    self.layout = layout
    self.max_staleness = max_staleness
    self.loss_scale = loss_scale
    self.max_loss = max_loss
    self.rate = rate
    with tf.device(step.device):
      self.lock = tf.CriticalSection(name="ps_update")

  def __call__(self, grads: Sequence[tf.Tensor], read_version: tf.Tensor,
               target: tf.Tensor, metrics: Mapping[str, tf.Tensor],
               computed_at: tf.Tensor) -> Dict[str, tf.Tensor]:
    """Applies `grads` if finite, fresh enough and within the budget, and
    records the outcome.

    Args:
      grads: unscaled gradients, one per variable.
      read_version: the value of `step` the worker read before the weights.
      target: the step this `train` call ends at; no update past it.
      metrics: the step's float32 metrics, by `layout.sums` name (`loss`
        among them).
      computed_at: the loss scale the gradients were computed at (1.0
        without loss scaling).

    Returns:
      Boolean scalars `applied`, `dropped`, `skipped`, `nonfinite`, and
      `tau` and `step` (after this update), available once the lock is
      released.
    """
    finite = optim.all_finite(grads)
    sane = ~tf.convert_to_tensor(step_lib.above_bound(metrics["loss"],
                                                      self.max_loss))

    def locked():
      now = self.step.read_value()
      tau = now - read_version
      # `accepts` is plain Python without a bound: make it a tensor.
      fresh = tf.convert_to_tensor(staleness.accepts(tau, self.max_staleness))
      apply = finite & sane & fresh & (now < target)
      applied = optim.apply_reduced(
          self.optimizer, grads, self.variables, apply,
          learning_rate=None if self.rate is None else self.rate(now))
      with tf.control_dependencies([applied]):  # 2. after the weights.
        counted = self.step.assign_add(tf.cast(apply, tf.int64))
      skipped = sane & self._answer_overflow(finite, apply, metrics["loss"],
                                             computed_at)
      outcome = {"applied": apply, "dropped": finite & sane & ~fresh,
                 "skipped": skipped, "nonfinite": ~sane | (~finite & ~skipped)}
      with tf.control_dependencies([counted]):  # 3. after the count.
        recorded = self.stats.assign_add(
            self.layout.record(outcome, tau, metrics))
      with tf.control_dependencies([recorded]):
        return {**outcome, "tau": tf.identity(tau),
                "step": counted.read_value()}

    with tf.device(self.step.device):
      return self.lock.execute(locked)

  def _answer_overflow(self, finite, applied, loss,
                       computed_at) -> tf.Tensor:
    """Moves the float16 loss scale: a good step for an applied update, a
    halving for an overflow at the scale in force. Returns whether a
    non-finite gradient is an overflow to skip (never without scaling)."""
    if self.loss_scale is None:
      return tf.constant(False)
    skip, halve = staleness.overflow(
        finite, tf.math.is_finite(loss), computed_at,
        self.loss_scale.scale.read_value())

    def update():
      self.loss_scale.update(applied)  # applied=False halves.
      return tf.constant(True)

    moved = tf.cond(applied | halve, update, lambda: tf.constant(False))
    with tf.control_dependencies([moved]):
      return tf.identity(skip)
