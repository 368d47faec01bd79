"""The loop base (`dist_loop/parallel/modes/loop.py`), with a scripted fake mode.

`_Scripted` has no model: each replica's step reads one row of a script,
(loss, applied, grad_norm), so a test says exactly what every replica
reports at every step and checks what `train` makes of it: means over
applied steps only, skipped steps, the step a bad step is named at, where
the loop stops, and how often the replicas communicate. One trainer per
configuration serves the whole module (`run` rewinds it), which also checks
that a rewind never traces a loop again.
"""

import numpy as np
import pytest
import tensorflow as tf

from dist_loop import make_config
from dist_loop.core.errors import NonFiniteError
from dist_loop.data import Dataset
from dist_loop.parallel.modes.loop import LoopTrainer, StepResult
from dist_loop.runtime import devices
from dist_loop.runtime import strategy as strategy_lib
from dist_loop.runtime.cluster import Cluster
from dist_loop.training import precision as precision_lib

NAN = float("nan")
R = 2  # Replicas.


class _Scripted(LoopTrainer):
  """Replica r's step t returns row t*R + r of `script`.

  A row is (loss, applied, grad_norm): the loss and grad_norm that replica
  reports, and whether the step's update counts as applied (> 0). Its
  accuracy is 0.25 at every step. A call of `train` is split into segments
  of `split` steps, the i-th one traced as "variant<i>".
  """

  def __init__(self, config, *, agree=True, loss_scale=False,
               strategy=True):
    x, y = np.zeros((8, 1), np.float32), np.zeros(8, np.int32)
    super().__init__(config, devices.configure(R, "cpu"),
                     Dataset(x, y, x, y, 2), Cluster())
    self.replicas_agree = agree
    self.strategy = strategy_lib.mirrored(self.devices) if strategy else None
    self.replicas = R if strategy else 1
    self.script = np.zeros((0, 3), np.float32)
    self.split = []
    with self.scope():
      self.step = tf.Variable(
          0, dtype=tf.int64, trainable=False,
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      if loss_scale:
        self.loss_scale = precision_lib.DynamicLossScale()

  def run(self, script, steps, split=None):
    """Rewinds to step 0 with a new script, then `train(steps)`."""
    self.script = np.asarray(script, np.float32).reshape(-1, 3)
    self.split = split or [steps]
    self.step.assign(0)
    self.on_restore()  # A new iterator, from step 0.
    return self.train(steps)

  def scope(self):
    return self.strategy.scope() if self.strategy else tf.device("/cpu:0")

  def _make_iterator(self, dataset_fn):
    del dataset_fn  # The script instead of the examples.
    rows = self.script[int(self.step.numpy()) * self.replicas:]
    # Each element stacks the step's rows of every replica.
    rows = rows.reshape(-1, self.replicas, 3) if self.strategy else rows
    return iter(tf.data.Dataset.from_tensor_slices(rows))

  def replica_step(self, batch, variant):
    del variant
    row = tf.reshape(batch, [3])
    shares = {"loss": row[0] / self.replicas,
              "accuracy": tf.constant(0.25 / self.replicas)}
    return StepResult(shares, row[1] > 0, {"grad_norm": row[2]})

  def loop_begin(self, start, num_steps):
    return [(n, f"variant{i}") for i, n in enumerate(self.split) if n]


def _rows(*steps):
  """Script rows from per-step (loss, applied, grad_norm), the same on
  every replica, or a list of one such triple per replica."""
  out = []
  for s in steps:
    out += list(s) if isinstance(s, list) else [s] * R
  return out


@pytest.fixture(scope="module")
def collectives():
  """Counts, per replica and per execution (not per trace), the
  all-reduces and all-gathers the module's replicas run."""
  counts = {"all_reduce": tf.Variable(0), "all_gather": tf.Variable(0)}
  with pytest.MonkeyPatch.context() as patch:
    for name, counter in counts.items():
      original = getattr(tf.distribute.ReplicaContext, name)

      def spy(self, *args, _original=original, _counter=counter, **kwargs):
        result = _original(self, *args, **kwargs)
        with tf.control_dependencies(tf.nest.flatten(result)):
          _counter.assign_add(1)
        return result

      patch.setattr(tf.distribute.ReplicaContext, name, spy)
    yield counts


@pytest.fixture(scope="module")
def trainer(collectives):
  """`trainer(**options)`: the module's trainer of those options (the
  flags `nonfinite`, `max_loss`; `_Scripted`'s keywords)."""
  del collectives  # Installed before any loop is traced.
  made = {}

  def get(nonfinite="raise", max_loss=0.0, **kwargs):
    key = (nonfinite, max_loss, tuple(sorted(kwargs.items())))
    if key not in made:
      config = make_config(workdir="/tmp/unused", dataset="synthetic",
                           num_devices=R, global_batch_size=R, seed=0,
                           nonfinite=nonfinite, max_loss=max_loss,
                           jit_compile=False)  # As decided on CPU.
      made[key] = _Scripted(config, **kwargs)
    return made[key]

  yield get
  for t in made.values():
    t.close()
  # However a module's calls were split, each variant was traced once.
  assert all(t.trace_counts == {f"variant{i}": 1 for i in
                                range(len(t.trace_counts))}
             for t in made.values())


def test_means_are_over_applied_steps_only(trainer):
  skip = trainer(nonfinite="skip")
  metrics = skip.run(_rows((1.0, 1, 10.0), (9.0, 0, 90.0), (3.0, 1, 30.0),
                           (5.0, 1, 50.0)), 4)
  assert metrics == {"train/loss": 3.0, "train/accuracy": 0.25,
                     "train/grad_norm": 30.0, "train/skipped_steps": 1.0,
                     "train/skipped_steps_at_end": 0.0}
  assert int(skip.step.numpy()) == 4  # A skipped step is a step.


def test_shares_are_summed_over_replicas_and_means_averaged(trainer):
  # Replica 0 reports loss 1 and norm 2, replica 1 loss 3 and norm 6: the
  # step's loss is the sum of the shares (each loss / R), the norm the mean.
  metrics = trainer().run(_rows([(1.0, 1, 2.0), (3.0, 1, 6.0)]), 1)
  assert metrics["train/loss"] == 2.0 and metrics["train/grad_norm"] == 4.0


def test_no_applied_step_reports_no_loss_never_zero(trainer):
  metrics = trainer(nonfinite="skip").run(_rows(*[(7.0, 0, 1.0)] * 3), 3)
  assert metrics == {"train/skipped_steps": 3.0,
                     "train/skipped_steps_at_end": 3.0}


def test_a_non_finite_loss_is_skipped_not_averaged(trainer):
  metrics = trainer(nonfinite="skip").run(
      _rows((2.0, 1, 1.0), (NAN, 0, NAN)), 2)
  assert metrics["train/loss"] == 2.0 and metrics["train/grad_norm"] == 1.0
  assert metrics["train/skipped_steps"] == 1.0


@pytest.mark.parametrize("applied,split,at_end", [
    ([1, 0, 0, 0], [1, 3], 3),  # The first segment's update, then skips.
    ([0, 1, 0, 0], [1, 3], 2),  # The first segment's skip is before it.
    ([0, 0, 1, 0], [2, 2], 1),
    ([0, 0, 0, 1], [2, 2], 0),
    ([0, 0, 0, 0], [1, 3], 4),  # None applied: every skip counts.
])
def test_skipped_steps_at_end_across_segments(trainer, applied, split,
                                              at_end):
  metrics = trainer(nonfinite="skip").run(
      _rows(*[(1.0, a, 1.0) for a in applied]), 4, split)
  assert metrics["train/skipped_steps"] == 4 - sum(applied)
  assert metrics["train/skipped_steps_at_end"] == at_end
  assert ("train/loss" in metrics) == any(applied)


def test_means_of_segments_weigh_their_applied_steps(trainer):
  metrics = trainer(nonfinite="skip").run(_rows(
      (1.0, 1, 1.0), (2.0, 0, 2.0), (4.0, 1, 4.0), (7.0, 1, 7.0)), 4, [2, 2])
  assert metrics["train/loss"] == 4.0 and metrics["train/grad_norm"] == 4.0


@pytest.mark.parametrize("loss", [1.0, NAN])
def test_a_bad_step_ends_an_agreeing_loop_at_that_step(trainer, loss):
  """A step not applied, whatever its loss, ends the loop there."""
  agreeing = trainer()
  with pytest.raises(NonFiniteError) as error:
    agreeing.run(_rows((1.0, 1, 1.0), (loss, 0, 1.0), (1.0, 1, 1.0),
                       (1.0, 1, 1.0)), 4)
  assert error.value.step == 2 and int(agreeing.step.numpy()) == 2


def test_a_non_finite_loss_of_an_applied_step_is_named_at_the_end(trainer):
  """Its update was applied on every replica, so the loop runs on; the
  step is still bad, and named when the loop ends."""
  agreeing = trainer()
  with pytest.raises(NonFiniteError) as error:
    agreeing.run(_rows((1.0, 1, 1.0), (NAN, 1, 1.0), (1.0, 1, 1.0)), 3)
  assert error.value.step == 2 and int(agreeing.step.numpy()) == 3


def test_a_non_agreeing_mode_names_its_first_bad_step_at_the_end(trainer):
  # Replica 1 fails at step 2, replica 0 at step 3: neither stops the loop.
  own = trainer(agree=False)
  with pytest.raises(NonFiniteError) as error:
    own.run(_rows((1.0, 1, 1.0), [(1.0, 1, 1.0), (1.0, 0, 1.0)],
                  [(NAN, 0, 1.0), (1.0, 1, 1.0)], (1.0, 1, 1.0)), 4)
  assert error.value.step == 2 and int(own.step.numpy()) == 4


def test_an_overflow_is_skipped_but_a_non_finite_loss_ends_the_loop(
    trainer, monkeypatch):
  """Under a loss scale, a step not applied is an overflow if its loss was
  finite on every replica; a non-finite loss on one replica alone is a bad
  step for all of them, at that step. Only those steps reduce the loss."""
  scaled = trainer(loss_scale=True)
  reduced = tf.Variable(0)
  original = scaled.strategy.reduce

  def spy(*args, **kwargs):
    result = original(*args, **kwargs)
    with tf.control_dependencies([result]):
      reduced.assign_add(1)
    return result

  monkeypatch.setattr(scaled.strategy, "reduce", spy)
  with pytest.raises(NonFiniteError) as error:
    scaled.run(_rows((1.0, 1, 1.0), (1.0, 0, 1.0),
                     [(1.0, 0, 1.0), (NAN, 0, 1.0)], (1.0, 1, 1.0)), 4)
  assert error.value.step == 3 and int(scaled.step.numpy()) == 3
  metrics = scaled.run(_rows((1.0, 1, 1.0), (1.0, 0, 1.0), (1.0, 1, 1.0),
                             (1.0, 0, 1.0)), 4)
  assert metrics["train/skipped_steps"] == 2.0
  assert metrics["train/loss"] == 1.0  # Over the two applied steps.
  assert metrics["train/loss_scale"] == precision_lib.INITIAL_SCALE
  assert int(reduced.numpy()) == 2 + 2  # The unapplied steps of each call.


def test_max_loss_ends_the_loop_on_the_loss_over_replicas(trainer):
  # Each replica's share (6) is below the bound, the step's loss above it.
  bounded = trainer(max_loss=10.0)
  with pytest.raises(NonFiniteError) as error:
    bounded.run(_rows((1.0, 1, 1.0), (12.0, 1, 1.0), (1.0, 1, 1.0)), 3)
  assert error.value.step == 2 and int(bounded.step.numpy()) == 2
  # Without a bound (--max_loss=0) the same loss is just a loss.
  unbounded = trainer()
  metrics = unbounded.run(_rows((1.0, 1, 1.0), (1e9, 1, 1.0),
                                (1.0, 1, 1.0)), 3)
  assert int(unbounded.step.numpy()) == 3
  assert metrics["train/loss"] == pytest.approx((1.0 + 1e9 + 1.0) / 3)


@pytest.mark.parametrize("max_loss", [0.0, 10.0])
def test_metrics_cross_replicas_once_per_loop(trainer, collectives,
                                              max_loss):
  before = {k: int(v.numpy()) for k, v in collectives.items()}
  t = trainer(max_loss=max_loss)
  t.run(_rows(*[(1.0, 1, 1.0)] * 3), 3)
  t.run(_rows(*[(1.0, 1, 1.0)] * 5), 5)
  ran = {k: int(v.numpy()) - before[k] for k, v in collectives.items()}
  # One gather per loop on each replica; with --max_loss one scalar
  # all-reduce per step, without it none.
  assert ran == {"all_gather": 2 * R, "all_reduce": 8 * R if max_loss else 0}


def test_without_a_strategy_the_step_runs_once(trainer):
  alone = trainer(strategy=False)
  assert alone.run([(1.0, 1, 2.0), (3.0, 1, 4.0)], 2)["train/loss"] == 2.0
  with pytest.raises(NonFiniteError, match="at step 2"):
    alone.run([(1.0, 1, 2.0), (5.0, 0, 6.0), (1.0, 1, 1.0)], 3)
  assert int(alone.step.numpy()) == 2


def test_each_variant_is_traced_once(trainer):
  skip = trainer(nonfinite="skip")
  for split in ([1, 2], [2, 1], [3]):
    skip.run(_rows(*[(1.0, 1, 1.0)] * 3), 3, split)
  assert skip.trace_counts == {"variant0": 1, "variant1": 1}
