"""The loop base: a mode that applies one update per step writes its build
and its step, and nothing else.

Orbit's `StandardTrainer` lets a trainer write only `train_step`; this is the
same idea for the modes whose every step is one update (sync, pipeline,
local_sgd, single_device). A mode builds its model, optimizer, `step`
variable and optional `strategy` in `__init__`, and implements
`replica_step(batch, variant) -> StepResult`. `LoopTrainer.train(n)` owns
the rest, written once:

1. **The input.** Built on first use from the step the run is at, so a
   resume or a rollback jumps to its position (`data/stream.py`), and
   handed to the replicas by the strategy (`make_iterator`). `close` and
   `on_restore` drop it (`_drop_input`).
2. **The traced loop** (`_loop_fn`): `n` steps in one `tf.function` call.
   Each step runs `replica_step` on every replica (`run_replicas`:
   `strategy.run`, or a direct call for a mode without a strategy), then
   advances the step counter, then calls `after_step` (local SGD's
   synchronisation every H steps).
3. **The metrics cross the network once per loop.** Each replica sums its
   own step results; one all-gather at the end of the loop brings every
   replica's sums to every replica. Per step, only the update itself
   communicates (and, with `--max_loss`, one scalar: the step's loss).
4. **Bad steps.** A step whose update was not applied (non-finite
   gradients) is skipped if the run allows it (`--nonfinite=skip`, or a
   float16 loss-scale overflow) and otherwise ends the loop; so does a step
   whose loss is above `--max_loss`. `train` raises `NonFiniteError` naming
   the step. A mode whose replicas do not agree on an update (local SGD:
   each applies its own) cannot stop them mid-loop, so its bad steps are
   reported when the loop ends.
5. **The metric tail** (`base.train_metrics`): means over applied steps,
   the task's report, the `train/` names.

What a step returns (`StepResult`): `shares`, this replica's share of each
task metric (`step.shares`: summed over replicas they are the update's
mean); `means`, values every replica reports on its own and that are
averaged over replicas (`grad_norm`: the norm of the reduced gradient, the
same on every replica); `applied`; and a `carry` kept from the last step
(the pipeline's timestamps).

`variant` names one traced loop among several a mode may run (`segments`
splits a call among them): the pipeline's timed and untimed steps, sync's
exact warm-up before a compressor starts. Modes with one loop ignore it.
"""

import abc
import dataclasses
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from dist_loop import step as step_core
from dist_loop.data import train_dataset_fn
from dist_loop.errors import NonFiniteError
from dist_loop.modes.base import Trainer, train_metrics

Variant = Optional[Hashable]
_NO_STEP = 2**53  # "No bad step": beyond any step, exact in float64.
# After the sums, each replica's row of `_gather` holds these counts.
_COUNTS = ("applied", "skipped", "skipped_at_end", "first_bad")


@dataclasses.dataclass
class StepResult:
  """One replica's view of one step (see the module docstring).

  Attributes:
    shares: this replica's share of each of the task's metrics, `loss`
      among them (float32 scalars; summed over replicas: the update's mean).
    applied: bool scalar: the update was applied. In a mode whose replicas
      apply one update together, the same on every replica.
    means: float32 scalars averaged over replicas (and over steps), at
      least those `mean_keys` names.
    carry: any nest of tensors kept from the last step that ran.
  """

  shares: Dict[str, tf.Tensor]
  applied: tf.Tensor
  means: Dict[str, tf.Tensor] = dataclasses.field(default_factory=dict)
  carry: Any = ()


class LoopTrainer(Trainer):
  """The base of the modes that apply one update per step.

  Attributes a subclass sets in `__init__` (besides `Trainer`'s):
    strategy: the `tf.distribute.Strategy` whose replicas run
      `replica_step`, or None to call it once per step on the host's
      device scope (the mode places its own ops).
  """

  strategy: Optional[tf.distribute.Strategy] = None
  # Whether every replica applies the same update (so a bad step is bad on
  # all of them, and the loop can stop at it). False for local SGD.
  replicas_agree = True
  # The `mean_keys` that `train` returns (a name without "/" gets the
  # `train/` prefix); the others only reach `on_segment`.
  reported_means: Tuple[str, ...] = ("grad_norm",)

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    self._iterator = None
    self._loops: Dict[Variant, Any] = {}
    self.trace_counts: Dict[Variant, int] = {}  # Traces of each variant.

  # -- what a mode writes --

  @abc.abstractmethod
  def replica_step(self, batch, variant: Variant) -> StepResult:
    """One step on one replica, in replica context (or directly)."""

  def mean_keys(self, variant: Variant) -> Tuple[str, ...]:
    """The keys of `StepResult.means` of `variant`'s steps."""
    del variant
    return ("grad_norm",)

  @tf.autograph.experimental.do_not_convert
  def after_step(self) -> None:
    """Traced after every step, in cross-replica context, once the step
    counter has advanced."""

  def segments(self, start: int, num_steps: int) -> List[Tuple[int, Variant]]:
    """How a call of `num_steps` from step `start` is split among the
    traced loops: [(steps, variant)], in order."""
    del start
    return [(num_steps, None)]

  def initial_carry(self, variant: Variant):
    del variant
    return ()

  def on_segment(self, variant: Variant, means: Dict[str, float],
                 carry) -> None:
    """After each segment of a call that applied at least one update, with
    its means and the last step's carry (numpy)."""

  def before_train(self) -> None:
    """At the start of every `train` call (after a restore: per-replica
    state back into the replicas)."""

  def make_iterator(self, dataset_fn):
    """The iterator of the training input: one global batch per `next`,
    split over the strategy's replicas if there is one."""
    if self.strategy is not None:
      return iter(self.strategy.distribute_datasets_from_function(dataset_fn))
    return iter(dataset_fn(tf.distribute.InputContext()))

  def run_replicas(self, fn, *args):
    """`fn(*args)` on every replica (`strategy.run`), or once."""
    if self.strategy is None:
      return fn(*args)
    return self.strategy.run(fn, args=args)

  # -- the loop, written once --

  @property
  def trace_count(self) -> int:
    """How many times a loop was traced (tests check it stays at one)."""
    return sum(self.trace_counts.values())

  def train(self, num_steps: int) -> Dict[str, float]:
    self.before_train()
    iterator = self._input()
    totals = _Totals()
    for count, variant in self.segments(int(self.step.numpy()), num_steps):
      sums, bad_step, carry = self._loop(variant)(
          iterator, tf.constant(count, tf.int64))
      part = _Totals(self.task.metric_names, self.mean_keys(variant),
                     np.asarray(sums))
      totals.add(part, keys=self.task.metric_names + self.reported_means)
      bad = [s for s in (int(bad_step), part.first_bad) if 0 <= s < _NO_STEP]
      if bad:
        raise NonFiniteError(min(bad))
      if part.applied:
        self.on_segment(variant, part.means(),
                        tf.nest.map_structure(np.asarray, carry))
    extra = {}
    if self.loss_scale is not None:
      extra["loss_scale"] = float(self.loss_scale.scale.numpy())
    return train_metrics(self.task, totals.means(), skipped=totals.skipped,
                         skipped_at_end=totals.skipped_at_end, extra=extra)

  def on_restore(self) -> None:
    self._drop_input()  # Rebuilt from the restored step.

  def close(self) -> None:
    self._drop_input()

  def _input(self):
    """The training iterator, built on first use from the current step."""
    if self._iterator is None:
      fn = train_dataset_fn(self.dataset.train_x, self.dataset.train_y,
                            self.examples_per_step, self.config.seed,
                            start_step=int(self.step.numpy()))
      self._iterator = self.make_iterator(fn)
    return self._iterator

  def _drop_input(self) -> None:
    # Freed now, while its threads can still finish: destroyed at
    # interpreter exit a multi-device iterator can block for minutes.
    self._iterator = None

  def _loop(self, variant: Variant):
    if variant not in self._loops:
      self.trace_counts[variant] = 0
      self._loops[variant] = tf.function(
          lambda iterator, n: self._loop_fn(iterator, n, variant))
    return self._loops[variant]

  def _loop_fn(self, iterator, num_steps, variant):
    self.trace_counts[variant] += 1  # Python side effect: once per trace.
    keys = self._sum_keys(variant)
    skip_all = self.config.nonfinite == "skip"
    may_skip = skip_all or self.loss_scale is not None
    max_loss = self.config.max_loss

    def replica(batch, totals):
      out = self.replica_step(batch, variant)
      loss = out.shares["loss"]
      loss_ok = tf.math.is_finite(loss)
      counted = tf.logical_and(out.applied, loss_ok)
      values = {**out.shares, **out.means}
      new = {k: tf.where(counted, totals[k] + values[k], totals[k])
             for k in keys}
      new["applied"] = totals["applied"] + tf.cast(counted, tf.float64)
      skipped = tf.logical_and(tf.logical_not(out.applied), may_skip)
      new["skipped"] = totals["skipped"] + tf.cast(skipped, tf.float64)
      new["skipped_at_end"] = tf.where(
          out.applied, tf.constant(0.0, tf.float64),
          totals["skipped_at_end"] + tf.cast(skipped, tf.float64))
      bad = tf.logical_or(
          tf.logical_and(tf.logical_not(out.applied), not may_skip),
          tf.logical_and(tf.logical_not(loss_ok), not skip_all))
      this_step = tf.cast(tf.convert_to_tensor(self.step) + 1, tf.float64)
      new["first_bad"] = tf.where(
          bad, tf.minimum(totals["first_bad"], this_step),
          totals["first_bad"])
      if max_loss:  # The step's loss over all replicas: one scalar.
        loss = self._sum_over_replicas(loss)
      return new, out.applied, loss, out.carry

    totals = self.run_replicas(lambda: self._zeros(keys))
    carry = self.initial_carry(variant)
    bad_step = tf.constant(-1, tf.int64)
    for _ in tf.range(num_steps):
      totals, applied, loss, new_carry = self.run_replicas(
          replica, next(iterator), totals)
      self.step.assign_add(1)
      self.after_step()
      applied, loss = self._first((applied, loss))
      stop = step_core.above_bound(loss, max_loss)
      if self.replicas_agree and not may_skip:
        stop = tf.logical_or(stop, tf.logical_not(applied))
      if stop:
        bad_step = self.step.read_value()
        break
      carry = self._first(new_carry)
    sums = self._first(self.run_replicas(self._gather, totals, keys))
    return sums, bad_step, carry

  def _sum_keys(self, variant: Variant) -> Tuple[str, ...]:
    return tuple(self.task.metric_names) + tuple(self.mean_keys(variant))

  @staticmethod
  def _zeros(keys: Sequence[str]) -> Dict[str, tf.Tensor]:
    totals = {k: tf.constant(0.0) for k in keys}
    zero = tf.constant(0.0, tf.float64)
    totals.update(applied=zero, skipped=zero, skipped_at_end=zero,
                  first_bad=tf.constant(float(_NO_STEP), tf.float64))
    return totals

  def _gather(self, totals, keys):
    """Every replica's sums as rows of one matrix: one collective."""
    row = tf.stack([tf.cast(totals[k], tf.float64) for k in keys]
                   + [totals[k] for k in _COUNTS])[None]
    if self.strategy is None:
      return row
    # A fresh tensor on the replica's device: a loop's output may have
    # none, which a multi-worker collective refuses.
    return tf.distribute.get_replica_context().all_gather(
        tf.identity(row), axis=0)

  def _sum_over_replicas(self, value):
    if self.strategy is None:
      return value
    return tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, value)

  def _first(self, values):
    """The first replica's value of each (per-replica) value."""
    if self.strategy is None:
      return values
    return tf.nest.map_structure(
        lambda v: self.strategy.experimental_local_results(v)[0], values)


class _Totals:
  """Sums over applied steps, combined on the host.

  Built from a loop's gathered matrix [replicas, keys + counts] (`_gather`):
  each replica's sums are divided by the steps it counted, then shares are
  summed over replicas and means averaged. `add` merges the segments of a
  call, weighting each by its applied steps.
  """

  def __init__(self, share_keys: Sequence[str] = (),
               mean_keys: Sequence[str] = (),
               rows: Optional[np.ndarray] = None):
    self._weighted: Dict[str, float] = {}  # Sum of mean x applied steps.
    self.applied = 0
    self.skipped = 0
    self.skipped_at_end = 0  # Skipped steps since the last applied one.
    self.first_bad = _NO_STEP
    self._means: Dict[str, float] = {}
    if rows is None:
      return
    share_keys, keys = tuple(share_keys), tuple(share_keys) + tuple(mean_keys)
    counts = dict(zip(_COUNTS, rows[:, len(keys):].T))
    counted = counts["applied"]
    self.applied = int(counted[0])
    self.skipped = int(counts["skipped"][0])
    self.skipped_at_end = int(counts["skipped_at_end"][0])
    self.first_bad = int(counts["first_bad"].min())
    per_step = rows[:, :len(keys)] / np.maximum(counted, 1)[:, None]
    n = len(share_keys)
    self._means = dict(zip(share_keys, per_step[:, :n].sum(axis=0)))
    self._means.update(zip(keys[n:], per_step[:, n:].mean(axis=0)))
    self._means = {k: float(v) for k, v in self._means.items()}

  def add(self, other: "_Totals", keys: Sequence[str]) -> None:
    """Adds a segment's `keys` (those it has)."""
    for k in keys:
      if k in other._means:  # pylint: disable=protected-access
        self._weighted[k] = (self._weighted.get(k, 0.0)
                             + other._means[k] * other.applied)  # pylint: disable=protected-access
    self.skipped_at_end = (other.skipped_at_end if other.applied
                           else self.skipped_at_end + other.skipped)
    self.applied += other.applied
    self.skipped += other.skipped
    self.first_bad = min(self.first_bad, other.first_bad)

  def means(self) -> Dict[str, float]:
    """The segment's means, or a call's over its applied steps; empty if no
    step was applied (a skipped step never reports a loss of 0)."""
    if self._means:
      return dict(self._means) if self.applied else {}
    if not self.applied:
      return {}
    return {k: v / self.applied for k, v in self._weighted.items()}
