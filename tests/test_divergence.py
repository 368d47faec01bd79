"""The divergence guard, `--max_loss`: a step whose finite loss is above
the bound is handled like a non-finite step, in every mode that honours it.

The async applier and the ps locked update are tested here directly (the
loop base's guard, with scripted losses, in test_loop.py); end to end, a run
that diverges (Adam at a learning rate of 1e9) stops at its second step, or
is refused at the door by a mode that does not honour the flag.
"""

import json
import os
import types

import pytest
import tensorflow as tf

from dist_loop import train
from dist_loop.core.errors import DivergedError, NonFiniteError, UserError
from dist_loop.parallel import staleness
from dist_loop.parallel.modes import MODES
from dist_loop.parallel.modes.asynchronous.applier import Applier
from dist_loop.parallel.modes.asynchronous.worker import Push
from dist_loop.parallel.modes.ps import stats, update
from dist_loop.training import optim
from experiments.extensions import single_device  # noqa: F401  (registers it)
from helpers import make_trainer


def test_async_does_not_apply_a_push_above_max_loss():
  w = tf.Variable([1.0, 2.0])
  step = tf.Variable(0, dtype=tf.int64)
  model = types.SimpleNamespace(trainable_variables=[w])
  applier = Applier(model, optim.make("sgd", 1.0, [w]), step, "/cpu:0",
                    max_loss=100.0)

  def push(loss):
    return Push(0, applier.version, [tf.ones(2)], [tf.identity(w)],
                {"loss": tf.constant(loss)})

  assert applier.offer(push(5.0)).applied and w.numpy().tolist() == [0, 1]
  outcome = applier.offer(push(500.0))
  assert not outcome.applied and not outcome.finite
  assert w.numpy().tolist() == [0, 1] and applier.version == 1


def test_ps_records_a_loss_above_max_loss_as_nonfinite():
  layout = stats.Layout(("loss",))
  w = tf.Variable([1.0, 2.0])
  step = tf.Variable(0, dtype=tf.int64)
  locked = update.LockedUpdate(
      optimizer=optim.make("sgd", 1.0, [w]), variables=[w], step=step,
      stats=tf.Variable(tf.zeros([layout.size], tf.float64)), layout=layout,
      max_staleness=staleness.NO_BOUND, max_loss=100.0)
  offer = tf.function(lambda loss: locked(
      [tf.ones(2)], step.read_value(), tf.constant(10, tf.int64),
      {"loss": loss, "grad_norm": tf.constant(1.0)}, tf.constant(1.0)),
                      autograph=False)
  assert offer(tf.constant(5.0))["applied"]
  out = offer(tf.constant(500.0))
  assert out["nonfinite"] and not (out["applied"] or out["skipped"])
  assert w.numpy().tolist() == [0, 1] and int(step.numpy()) == 1
  assert layout.read(locked.stats.numpy()).counts["nonfinite"] == 1


# Whether each mode honours --max_loss, stated here rather than read from
# the code under test: local SGD's replicas apply their own updates, so no
# step has one loss to compare with the bound.
HONOURS_MAX_LOSS = {"sync": True, "pipeline": True, "async": True,
                    "single_device": True, "local_sgd": False}


@pytest.mark.parametrize("mode", sorted(HONOURS_MAX_LOSS))
def test_max_loss_stops_a_diverging_run_or_is_refused(small_config, mode,
                                                      eager_costs):
  """Adam at a learning rate of 1e9 gives finite losses of ~1e9 from the
  second step on (see the next test): every mode that honours --max_loss
  stops there; the others refuse the flag at the door. The mode's trainer
  alone, but for sync: a whole run, that says what to do. The pipeline
  plans from eagerly timed layer costs (conftest.py): planning is not the
  point here."""
  del eager_costs  # Used for its effect.
  extra = {"pipeline": dict(num_devices=2, num_stages=2,
                            num_microbatches=2),
           "local_sgd": dict(sync_every=2)}.get(mode, {})
  cfg = small_config(mode=mode, optimizer="adam", learning_rate=1e9,
                     max_loss=100.0, train_steps=4, steps_per_loop=2,
                     **extra)
  if not HONOURS_MAX_LOSS[mode]:
    with pytest.raises(UserError, match=f"--max_loss is not supported in "
                       f"--mode={mode}"):
      train.run(cfg)
    return
  if mode == "sync":
    with pytest.raises(NonFiniteError,
                       match="a loss above --max_loss=100") as e:
      train.run(cfg)
    assert e.value.step == 2
    return
  trainer = make_trainer(cfg)
  try:
    with pytest.raises(NonFiniteError) as e:
      for _ in range(2):
        trainer.train(2)
  finally:
    trainer.close()
  assert e.value.step == 2


def test_without_max_loss_a_diverging_run_ends_as_diverged(small_config):
  """No --max_loss: the run trains to its end, saves, and then exits 3."""
  cfg = small_config(optimizer="adam", learning_rate=1e9, train_steps=4,
                     steps_per_loop=2)
  with pytest.raises(DivergedError, match="the run diverged") as raised:
    train.run(cfg)
  summary = raised.value.summary
  assert summary["final_step"] == 4 and summary["train_loss"] > 1e3
  assert summary["diverged"]
  with open(os.path.join(cfg.workdir, "summary.json")) as f:
    assert json.load(f)["final_step"] == 4


def test_max_loss_refuses_skip(small_config):
  with pytest.raises(UserError, match="cannot be combined with "
                     "--nonfinite=skip"):
    train.run(small_config(max_loss=10.0, nonfinite="skip"))


def test_every_mode_says_whether_it_honours_max_loss():
  """ps honours it too (tested on its locked update above; a run needs a
  cluster)."""
  expected = {**HONOURS_MAX_LOSS, "ps": True}
  assert {name: MODES.get(name).checks_max_loss for name in expected} \
      == expected
