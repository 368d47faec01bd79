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
"""

import collections
import dataclasses
import threading
from typing import Callable, Dict, List, Sequence, Tuple

import keras
import tensorflow as tf

from dist_loop import optim
from dist_loop.async_ import policies
from dist_loop.async_.worker import Push


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What `offer` did with one push."""

  tau: int
  applied: bool
  finite: bool = True
  grad_norm: float = 0.0
  lr_scale: float = 1.0


class Applier:
  """Owns the master model, optimizer and step; applies stale gradients.

  Args:
    model: the master model.
    optimizer: built over `model.trainable_variables`.
    step: int64 variable, the number of applied updates (= the version).
    device: where the update runs (the master variables' device).
    max_staleness: drop gradients with tau > this; -1: no bound.
    staleness_lr: `fn(tau) -> learning-rate factor`.
    compensation: `fn(grads, now, read, dc_lambda) -> grads`.
    dc_lambda: the delay-compensation strength.
  """

  def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
               step: tf.Variable, device: str, max_staleness: int = -1,
               staleness_lr: Callable[[int], float] = policies.constant,
               compensation: Callable = policies.no_compensation,
               dc_lambda: float = 0.0):
    self.model = model
    self.optimizer = optimizer
    self.step = step
    self.device = device
    self.max_staleness = max_staleness
    self.staleness_lr = staleness_lr
    self.compensation = compensation
    self.dc_lambda = dc_lambda
    self.lock = threading.Lock()
    self.version = int(step.numpy())
    self.staleness_counts: Dict[int, int] = collections.Counter()
    self.dropped = 0
    self._read_fn = tf.function(self._read)
    self._apply_fn = tf.function(self._apply)

  def sync_version(self) -> None:
    """Re-reads the version from `step` (after a checkpoint restore)."""
    with self.lock:
      self.version = int(self.step.numpy())

  def trace(self) -> None:
    """Traces `read` and the update now, before any thread needs them."""
    specs = [tf.TensorSpec(v.shape, v.dtype)
             for v in self.model.trainable_variables]
    self._read_fn.get_concrete_function()
    self._apply_fn.get_concrete_function(specs, specs,
                                         tf.TensorSpec((), tf.float32))

  @property
  def applied(self) -> int:
    return sum(self.staleness_counts.values())

  def read(self) -> Tuple[int, List[tf.Tensor]]:
    """(version, master weights), read atomically with respect to updates."""
    with self.lock:
      return self.version, self._read_fn()

  def offer(self, push: Push) -> Outcome:
    """Applies `push` or drops it, by the policies. Single caller only."""
    tau = self.version - push.version
    if tau < 0:
      raise RuntimeError(f"{push.worker=} read version {push.version}, ahead "
                         f"of the master's {self.version}")
    if not policies.accepts(tau, self.max_staleness):
      self.dropped += 1
      return Outcome(tau, applied=False)
    scale = float(self.staleness_lr(tau))
    with self.lock:
      ok, norm = self._apply_fn(push.grads, push.read,
                                tf.constant(scale, tf.float32))
      ok = bool(ok)
      if ok:
        self.version += 1
    if ok:
      self.staleness_counts[tau] += 1
    return Outcome(tau, applied=ok, finite=ok, grad_norm=float(norm),
                   lr_scale=scale)

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
      ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
      optim.apply_reduced(self.optimizer, grads, variables, ok,
                          lr_scale=lr_scale)
      self.step.assign_add(tf.cast(ok, tf.int64))
      return ok, tf.linalg.global_norm(grads)
