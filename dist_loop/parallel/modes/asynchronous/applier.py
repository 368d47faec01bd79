"""The async applier: the master variables, their version, the policies.

The master version is the number of updates applied so far (the run's step),
so it survives a checkpoint. A worker reads (version, weights) atomically with
`read`; `offer` computes the staleness tau = version - push.version of a
gradient, drops it if the bound says so, else applies it with the policies
and moves the version on. A lock makes each read and each update atomic, so
a worker never sees half an update and `version` always names the weights.

Only one thread calls `offer` (the applier thread, or a test), so `version`
and the counts are plain Python numbers: the optimizer's own `iterations` is
not what counts updates here.

With float16 loss scaling, the applier owns the `DynamicLossScale`: `read`
returns the scale in force with the weights, and the worker sends back the
gradient unscaled, with the scale it used. Non-finite gradients of a finite
loss are then an overflow, and the push is skipped (neither applied nor
counted as an update), by the rule the ps mode applies too
(`staleness.overflow`). An applied push counts a good step towards the
scale's growth.

A push whose loss is above `--max_loss` (the step core's `above_bound`) is
a divergence: like a non-finite push, it is not applied and ends the run's
`train` call (the trainer raises `NonFiniteError`).
"""

import dataclasses
import threading
from typing import Callable, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from dist_loop.parallel import staleness
from dist_loop.parallel.modes.asynchronous import policies
from dist_loop.parallel.modes.asynchronous.worker import Push
from dist_loop.training import optim
from dist_loop.training import step as step_lib
from dist_loop.training.precision import DynamicLossScale


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What `offer` did with one push."""

  tau: int
  applied: bool
  finite: bool = True
  skipped: bool = False  # A loss-scale overflow: not applied, not an error.
  grad_norm: float = 0.0
  lr_scale: float = 1.0
  clipped: Optional[bool] = None  # None: no --clip_global_norm.


class Applier:
  """Owns the master model, optimizer and step; applies stale gradients.

  Args:
    model: the master model.
    optimizer: built over `model.trainable_variables`.
    step: int64 variable, the number of applied updates (= the version).
    device: where the update runs (the master variables' device).
    max_staleness: drop gradients with tau > this; NO_BOUND: no bound.
    staleness_lr: `fn(tau) -> learning-rate factor`.
    compensation: `fn(grads, now, read, dc_lambda) -> grads`.
    dc_lambda: the delay-compensation strength.
    loss_scale: the float16 loss scale, on `device`; None: no loss scaling.
    max_loss: a push whose loss is above it is not applied and counts as
      non-finite; 0: no bound.
    recipe: the rate of each update (a function of the version it makes)
      and the clipping of each push, after its delay compensation; None:
      the optimizer's rate, no clipping.
  """

  def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
               step: tf.Variable, device: str,
               max_staleness: int = staleness.NO_BOUND,
               staleness_lr: Callable[[int], float] = policies.constant,
               compensation: Callable = policies.no_compensation,
               dc_lambda: float = 0.0,
               loss_scale: Optional[DynamicLossScale] = None,
               max_loss: float = 0.0,
               recipe: Optional[optim.Recipe] = None):
    self.model = model
    self.recipe = recipe
    self.optimizer = optimizer
    self.step = step
    self.device = device
    self.max_staleness = max_staleness
    self.staleness_lr = staleness_lr
    self.compensation = compensation
    self.dc_lambda = dc_lambda
    self.loss_scale = loss_scale
    self.max_loss = max_loss
    self.lock = threading.Lock()
    self.version = int(step.numpy())
    self.staleness = staleness.Histogram()  # Of the applied updates.
    self.dropped = 0
    self.skipped = 0  # Loss-scale overflows.
    self._read_fn = tf.function(self._read, autograph=False)
    self._apply_fn = tf.function(self._apply, autograph=False)
    self._update_scale_fn = (tf.function(loss_scale.update, autograph=False)
                             if loss_scale is not None else None)

  def sync_version(self) -> None:
    """Re-reads the version from `step` (after a checkpoint restore)."""
    with self.lock:
      self.version = int(self.step.numpy())

  def trace(self) -> None:
    """Traces `read` and the updates now, before any thread needs them."""
    specs = [tf.TensorSpec(v.shape, v.dtype)
             for v in self.model.trainable_variables]
    self._read_fn.get_concrete_function()
    self._apply_fn.get_concrete_function(specs, specs,
                                         tf.TensorSpec((), tf.float32))
    if self._update_scale_fn is not None:
      self._update_scale_fn.get_concrete_function(tf.TensorSpec((), tf.bool))

  @property
  def applied(self) -> int:
    return self.staleness.total

  @property
  def current_loss_scale(self) -> float:
    """The loss scale in force; 1.0 without loss scaling."""
    if self.loss_scale is None:
      return 1.0
    return float(self.loss_scale.scale.numpy())

  def read(self) -> Tuple[int, List[tf.Tensor], float]:
    """(version, master weights, loss scale), read atomically with respect
    to updates: the scale is the one a gradient on these weights uses."""
    with self.lock:
      return self.version, self._read_fn(), self.current_loss_scale

  def offer(self, push: Push) -> Outcome:
    """Applies `push`, drops it (by the policies) or skips it (a loss-scale
    overflow). Single caller only."""
    tau = self.version - push.version
    if tau < 0:
      raise RuntimeError(f"{push.worker=} read version {push.version}, ahead "
                         f"of the master's {self.version}")
    if not staleness.accepts(tau, self.max_staleness):
      self.dropped += 1
      return Outcome(tau, applied=False)
    if bool(step_lib.above_bound(push.loss, self.max_loss)):
      return Outcome(tau, applied=False, finite=False)
    scale = float(self.staleness_lr(tau))
    with self.lock:
      ok, norm, clipped = self._apply_fn(push.grads, push.read,
                                         tf.constant(scale, tf.float32))
      ok = bool(ok)
      if ok:
        self.version += 1
        self._update_scale(True)
        skipped = False
      else:
        skipped = self._overflowed(push)
    if ok:
      self.staleness.add([tau])
    elif skipped:
      self.skipped += 1
    return Outcome(tau, applied=ok, finite=ok or skipped, skipped=skipped,
                   grad_norm=float(norm), lr_scale=scale,
                   clipped=bool(clipped) if self.recipe and
                   self.recipe.clip_norm else None)

  def _overflowed(self, push: Push) -> bool:
    """Whether the non-finite gradients of `push` are a loss-scale overflow,
    to skip, rather than a real non-finite step. Halves the scale once per
    overflow at the scale in force. Call with the lock held."""
    if self.loss_scale is None:
      return False
    skip, halve = staleness.overflow(
        tf.constant(False), tf.math.is_finite(push.loss),
        tf.constant(push.loss_scale, tf.float32), self.loss_scale.scale)
    if halve:
      self._update_scale(False)
    return bool(skip)

  def _update_scale(self, ok: bool) -> None:
    """Counts a good step, or halves the scale; nothing without scaling."""
    if self._update_scale_fn is not None:
      self._update_scale_fn(tf.constant(ok))

  # -- traced, on the master device --

  def _read(self):
    with tf.device(self.device):
      return [tf.identity(v) for v in self.model.trainable_variables]

  def _apply(self, grads: Sequence[tf.Tensor], read: Sequence[tf.Tensor],
             lr_scale: tf.Tensor):
    with tf.device(self.device):
      variables = self.model.trainable_variables
      now = [tf.identity(v) for v in variables]
      grads = self.compensation(grads, now, read, self.dc_lambda)
      ok = optim.all_finite(grads)
      norm = tf.linalg.global_norm(grads)
      rate, clipped = None, tf.constant(0.0)
      if self.recipe is not None:  # Per push: the norm of its gradient.
        grads, means = self.recipe.clip(grads, norm)
        clipped = means.get(optim.Recipe.CLIPPED, clipped)
        rate = self.recipe.rate(self.step.read_value())
      optim.apply_reduced(self.optimizer, grads, variables, ok,
                          lr_scale=lr_scale, learning_rate=rate)
      self.step.assign_add(tf.cast(ok, tf.int64))
      return ok, norm, clipped
