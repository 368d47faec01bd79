"""The loop base: a mode that applies one update per step writes its build,
its step, and at most a hook on each side of an inner loop.

Orbit's `StandardTrainer` lets a trainer write only `train_step`; this is the
same idea for the modes whose every step is one update (sync, pipeline,
local_sgd, single_device). A mode builds its model, optimizer, `step`
variable and optional `strategy` in `__init__`, implements
`replica_step(batch, variant) -> StepResult`, and may write a hook on each
side of an inner loop (`loop_begin`, `loop_end`), as Orbit's
`train_loop_begin` / `train_loop_end`. `LoopTrainer.train(n)` owns the
rest, written once:

1. **The input.** Built on first use from the step the run is at, so a
   resume or a rollback jumps to its position; read on the host and cut
   per replica in the traced step (`data/stream.py`, `_make_iterator`).
   `close` and `on_restore` drop it (`_drop_input`). The time each step
   waits for its batch is summed between two timestamps around the
   iterator's `next`: `input_wait_s` (`dist_loop/runtime/goodput.py` says
   why that is the wait; None under `--deterministic`: op determinism
   refuses timestamps).
2. **The traced loop** (`_loop_fn`): `n` steps per `tf.function` call.
   A step runs `replica_step` on every replica (`run_replicas`), advances
   the step counter, then calls `after_step` (local SGD's sync every H).
   Before `replica_step`, each replica writes the seeds of the model's
   random layers from the step (`training/seeds.py`), so a resumed run
   draws the dropout masks of an uninterrupted one.
3. **The metrics cross the network once per loop.** Each replica sums its
   own step results; one all-gather at the end of the loop brings every
   replica's sums to every replica (`step.py`: `add_step`, `LoopSums`).
   Per step, only the update itself communicates (and a scalar, the
   step's loss, where 4 needs it).
4. **Bad steps.** A step whose update was not applied (non-finite
   gradients) is skipped if the run allows it (`--nonfinite=skip`, or a
   float16 loss-scale overflow of a finite loss) and otherwise ends the
   loop, as does a loss above `--max_loss`; `train` raises
   `NonFiniteError` naming the step. Every replica must end the loop at the
   same step (one that left early would leave the others waiting in a
   collective), so the loop decides from values all replicas share:
   `applied` (it follows the update's all-reduce) and the step's loss
   summed over replicas, reduced only with `--max_loss` and, under a loss
   scale, on a step not applied. A mode whose replicas each apply their
   own update (local SGD) cannot stop them, so its bad steps are reported
   when the loop ends; so is a replica's non-finite loss in a step whose
   update was applied.
5. **The metric tail** (`base.train_metrics`): means over applied steps,
   the task's report, the `train/` names.

`variant` names one traced loop among several a mode may run (`loop_begin`
splits a call among them): the pipeline's timed and untimed steps, sync's
exact warm-up before a compressor starts. Modes with one loop ignore it.
What a mode needs besides its step reaches it as a value: `loop_begin`
gets the step the call starts at and its length, `loop_end` the call's
wall time, whether it traced, and the updates each variant applied
(`LoopEnd`). A mode never reads the controller's schedule.

**AutoGraph for the mode's code, not the loop's.** The loop is traced with
`autograph=False`, as is every `tf.function` of the library (and the
input's tf.data functions), so its Python runs once, at trace time, and
its control flow on tensors is written out (`tf.while_loop` here and in
`step.accumulated_gradients`). A mode written outside dist_loop has its
`replica_step` and `after_step` converted with AutoGraph when the loop is
first traced (`dist_loop/runtime/user_code.py`), so a Python `if` on a tensor or
a `for` over `tf.range` works there as in TensorFlow's guides; a class that
sets `autograph = False` opts out. The library's own modes are not
converted (`user_code.py` says why).
"""

import abc
import dataclasses
import time
from typing import Any, Dict, Hashable, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from dist_loop.core.errors import NonFiniteError
from dist_loop.data import stream, train_dataset_fn
from dist_loop.parallel.modes.base import Trainer, train_metrics
from dist_loop.runtime import user_code
from dist_loop.training import seeds
from dist_loop.training import step as step_core

Variant = Optional[Hashable]


@dataclasses.dataclass
class StepResult:
  """One replica's view of one step.

  Attributes:
    shares: this replica's share of each of the task's metrics, `loss`
      among them (float32 scalars, `step.shares`; summed over replicas:
      the update's mean).
    applied: bool scalar: the update was applied. In a mode whose replicas
      apply one update together, the same on every replica.
    means: float32 scalars each replica reports on its own, averaged over
      replicas (and over steps): the mode's `reported_means` (`grad_norm`:
      the norm of the reduced gradient).
  """

  shares: Dict[str, tf.Tensor]
  applied: tf.Tensor
  means: Dict[str, tf.Tensor] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LoopEnd:
  """What `loop_end` learns of the call that just ended.

  Attributes:
    seconds: the call's wall time.
    traced: whether the call traced a loop (its time is then mostly not
      the steps').
    applied: {variant: updates applied by its steps in this call}.
  """

  seconds: float
  traced: bool
  applied: Dict[Variant, int]


class LoopTrainer(Trainer):
  """The base of the modes that apply one update per step.

  What a mode writes: its build (`__init__`), `replica_step`, and if it
  needs them `loop_begin`, `loop_end` and the traced `after_step`; and two
  class attributes, `replicas_agree` and `reported_means`.

  Attributes a subclass sets in `__init__` (besides `Trainer`'s):
    strategy: the `tf.distribute.Strategy` whose replicas run
      `replica_step`, or None to call it once per step on the host's
      device scope (the mode places its own ops).
  """

  strategy: Optional[tf.distribute.Strategy] = None
  # Whether every replica applies the same update (so a bad step is bad on
  # all of them, and the loop can stop at it). False for local SGD.
  replicas_agree = True
  # The keys of `StepResult.means`, which `train` returns (a name without
  # "/" gets the `train/` prefix).
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

  def loop_begin(self, start: int, num_steps: int
                 ) -> List[Tuple[int, Variant]]:
    """Before a call of `num_steps` from step `start` (after a restore:
    per-replica state back into the replicas). Returns how the call is
    split among the traced loops: [(steps, variant)], in order."""
    del start
    return [(num_steps, None)]

  def loop_end(self, end: LoopEnd) -> None:
    """After a call whose steps were all good (host work: a refresh, a
    measurement)."""

  def after_step(self) -> None:
    """Traced after every step, in cross-replica context, once the step
    counter has advanced."""

  def seeded_model(self):
    """The model whose random layers (dropout) a step runs: their seeds
    are written before each step (`training/seeds.py`). `model`, unless
    the mode trains another copy (local SGD's `replica_model`); None: no
    model, no seeds."""
    return getattr(self, "model", None)

  def _make_iterator(self, dataset_fn):
    """The iterator of this process's training input, read once per step
    by the traced loop: the step's batch, or with a strategy the local
    replicas' batches stacked (`data/stream.py: replica_input`), which
    the loop hands to the replicas (`replica_batches`)."""
    if self.strategy is None:
      return iter(dataset_fn(tf.distribute.InputContext()))
    return stream.replica_input(self.strategy, dataset_fn,
                                stream.pipeline_id(self.cluster))

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
    t0, traces = time.perf_counter(), self.trace_count
    segments = self.loop_begin(int(self.step.numpy()), num_steps)
    iterator = self._input()
    totals = step_core.LoopSums()
    keys = self.task.metric_names + self._mean_keys()
    applied: Dict[Variant, int] = {}
    waited = 0.0
    for count, variant in segments:
      rows, bad_step, wait = self._loop(variant)(
          iterator, tf.constant(count, tf.int64))
      waited += float(wait)
      part = step_core.LoopSums(self.task.metric_names, self._mean_keys(),
                                np.asarray(rows))
      totals.add(part, keys=keys)
      bad = [s for s in (int(bad_step), part.first_bad)
             if 0 <= s < step_core.NO_STEP]
      if bad:
        raise NonFiniteError(min(bad))
      applied[variant] = applied.get(variant, 0) + part.applied
    self.loop_end(LoopEnd(time.perf_counter() - t0,
                          self.trace_count != traces, applied))
    extra = ({} if self.loss_scale is None else
             {"loss_scale": float(self.loss_scale.scale.numpy())})
    self.input_wait_s = None if self.config.deterministic else waited
    return train_metrics(self.task, totals.means(), skipped=totals.skipped,
                         skipped_at_end=totals.skipped_at_end, extra=extra)

  def on_restore(self) -> None:
    self._drop_input()  # Rebuilt from the restored step.

  def close(self) -> None:
    self._drop_input()  # Bounded: its tf.data threads only need stopping.

  def _input(self):
    """The training iterator, built on first use from the current step."""
    if self._iterator is None:
      fn = train_dataset_fn(self.dataset.train_x, self.dataset.train_y,
                            self.examples_per_step, self.config.seed,
                            start_step=int(self.step.numpy()))
      self._iterator = self._make_iterator(fn)
    return self._iterator

  def _drop_input(self) -> None:
    self._iterator = None  # Freed now, not at interpreter exit.

  def _loop(self, variant: Variant):
    if variant not in self._loops:
      self.trace_counts[variant] = 0
      self._loops[variant] = tf.function(
          lambda iterator, n: self._loop_fn(iterator, n, variant),
          autograph=False)
    return self._loops[variant]

  def _loop_fn(self, iterator, num_steps, variant):
    self.trace_counts[variant] += 1  # Python side effect: once per trace.
    keys = tuple(self.task.metric_names) + self._mean_keys()
    # A step not applied is skipped, not bad, under a loss scale (an
    # overflow) or --nonfinite=skip (which skips any bad step).
    skip_all = self.config.nonfinite == "skip"
    may_skip = skip_all or self.loss_scale is not None
    max_loss = self.config.max_loss

    replica_step = user_code.convert(self.replica_step)
    after_step = user_code.convert(self.after_step)
    model = self.seeded_model()
    random_states = [] if model is None else seeds.generator_states(model)

    def replica(batch, sums):
      if random_states:  # A step's masks from the step (module docstring, 2).
        seeds.reseed(random_states, self.config.seed, self.step,
                     self._replica_index())
      out = replica_step(batch, variant)
      loss = out.shares["loss"]
      sums = step_core.add_step(
          sums, {**out.shares, **out.means}, applied=out.applied,
          loss_ok=tf.math.is_finite(loss), may_skip=may_skip,
          skip_all=skip_all, step=tf.convert_to_tensor(self.step) + 1)
      if max_loss:  # The step's loss over all replicas: one scalar.
        loss = self._sum_over_replicas(loss)
      return sums, out.applied, loss

    timed = not self.config.deterministic  # Op determinism: no timestamps.

    def step(i, sums, bad_step, waited):
      if timed:
        # The wait for the batch: the iterations run one after another,
        # and the control dependencies order timestamp, next, timestamp,
        # step. The step waits for the second timestamp: on one inter-op
        # thread it would otherwise queue behind the step's own ops.
        t0 = tf.timestamp()
        with tf.control_dependencies([t0]):
          batch = next(iterator)
        with tf.control_dependencies(tf.nest.flatten(batch)):
          t1 = tf.timestamp()
        with tf.control_dependencies([t1]):
          batch = tf.nest.map_structure(tf.identity, batch)
        waited += t1 - t0
      else:
        batch = next(iterator)
      if self.strategy is not None:  # Each replica's own.
        batch = stream.replica_batches(self.strategy, batch)
      sums, applied, loss = self.run_replicas(replica, batch, sums)
      self.step.assign_add(1)
      after_step()
      ends = self._ends_loop(self._first(applied), loss, skip_all, may_skip)
      if ends is not False:  # `train` raises.
        bad_step = tf.where(ends, self.step.read_value(), bad_step)
      return i + 1, sums, bad_step, waited

    def more(i, sums, bad_step, waited):
      del sums, waited
      return tf.logical_and(i < num_steps, bad_step < 0)

    start = (tf.constant(0, tf.int64),
             self.run_replicas(lambda: step_core.zero_sums(keys)),
             tf.constant(-1, tf.int64), tf.constant(0.0, tf.float64))
    _, sums, bad_step, waited = tf.while_loop(more, step, start)
    rows = self._first(self.run_replicas(self._gather, sums, keys))
    return rows, bad_step, waited

  def _mean_keys(self) -> Tuple[str, ...]:
    """The mode's mean keys and the recipe's (`clipped_fraction`)."""
    return tuple(self.reported_means) + self.recipe.mean_keys

  def _ends_loop(self, applied, loss, skip_all: bool, may_skip: bool):
    """Whether the step just run ends the loop, from values every replica
    shares (module docstring, 4); `loss` is each replica's (summed with
    --max_loss). Python False when nothing can end it: no op is traced."""
    max_loss = self.config.max_loss
    total = None  # The step's loss over all replicas, where it is known.
    if max_loss:
      total = self._first(loss)
    elif self.replicas_agree and may_skip and not skip_all:
      # Not applied under a loss scale: an overflow if the loss was finite
      # on every replica, else bad. Applied steps reduce nothing.
      total = tf.cond(applied, lambda: tf.constant(0.0),
                      lambda: self._reduce_over_replicas(loss))
    stop = step_core.above_bound(total, max_loss) if max_loss else False
    if not self.replicas_agree:
      return stop
    if not may_skip:
      stop = tf.logical_or(stop, tf.logical_not(applied))
    if total is not None and not skip_all:
      stop = tf.logical_or(stop, tf.logical_not(tf.math.is_finite(total)))
    return stop

  def _gather(self, sums, keys):
    """Every replica's sums as rows of one matrix: one collective."""
    row = step_core.sums_row(sums, keys)
    if self.strategy is None:
      return row
    # A fresh tensor on the replica's device: a loop's output may have
    # none, which a multi-worker collective refuses.
    return tf.distribute.get_replica_context().all_gather(
        tf.identity(row), axis=0)

  def _sum_over_replicas(self, value):
    """In replica context: `value` summed over the replicas."""
    if self.strategy is None:
      return value
    context = tf.distribute.get_replica_context()
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)

  def _reduce_over_replicas(self, value):
    """In cross-replica context (where, unlike in the replica function, a
    collective may sit in a `tf.cond`): the per-replica `value` summed."""
    if self.strategy is None:
      return value
    return self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)

  def _replica_index(self):
    """In replica context: the replica's index among all replicas."""
    if self.strategy is None:
      return 0
    return tf.distribute.get_replica_context().replica_id_in_sync_group

  def _first(self, values):
    """The first replica's value of each (per-replica) value."""
    if self.strategy is None:
      return values
    return tf.nest.map_structure(
        lambda v: self.strategy.experimental_local_results(v)[0], values)
