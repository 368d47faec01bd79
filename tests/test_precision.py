"""Mixed precision and loss scaling; what each mode refuses; and the one
accuracy test of sync (digits), against which the precisions compare. The
float16 digits run is on 2 replicas, and an overflow injected after it must
skip the step on both."""

import numpy as np
import pytest
import tensorflow as tf

from dist_loop import configure, make_config
from dist_loop.control.evaluation import Evaluator
from dist_loop.core.errors import UserError
from dist_loop.parallel.modes import MODES, Trainer
from dist_loop.parallel.modes.base import Reporting
from dist_loop.runtime.cluster import Cluster
from dist_loop.training.precision import PRECISIONS, DynamicLossScale
from helpers import make_trainer, replica_copies

DIGITS = dict(dataset="digits", model="mlp", optimizer="adam",
              learning_rate=0.01, global_batch_size=64, train_steps=150,
              steps_per_loop=50, log_every=50, eval_every=150,
              checkpoint_every=150, seed=0)


def _accuracy(workdir, precision, then=None, **mode):
  """(eval accuracy, the trainer's summary) of 150 steps on digits, trained
  in this process (sync unless `mode` says otherwise); `then(trainer)`
  runs on the trained trainer before it is closed."""
  trainer = make_trainer(make_config(workdir=workdir, precision=precision,
                                     **DIGITS, **mode))
  trainer.train(DIGITS["train_steps"])
  with trainer.scope():
    accuracy = Evaluator(trainer.model, trainer.dataset, 256,
                         trainer.task).evaluate()["eval/accuracy"]
  summary = trainer.summary() if isinstance(trainer, Reporting) else {}
  if then is not None:
    then(trainer)
  trainer.close()
  return accuracy, summary


@pytest.fixture(name="float32_accuracy", scope="module")
def _float32_accuracy(tmp_path_factory):
  return _accuracy(str(tmp_path_factory.mktemp("f32")), "float32")[0]


def test_sync_learns_digits_in_every_precision(float32_accuracy, tmp_path):
  """float16 runs on 2 replicas, whose trained trainer then overflows
  (`_overflow_skips_the_step_on_every_replica`)."""
  assert float32_accuracy > 0.9
  for precision, extra in (
      ("mixed_bfloat16", {}),
      ("mixed_float16", dict(num_devices=2,
                             then=_overflow_skips_the_step_on_every_replica))):
    accuracy, _ = _accuracy(str(tmp_path / precision), precision, **extra)
    assert abs(accuracy - float32_accuracy) <= 0.01, (precision, accuracy)


def test_mixed_precision_in_pipeline_and_async_modes(
    float32_accuracy, tmp_path, eager_costs):
  # The traced measurement of layer costs is test_pipeline_v2.py's.
  # float16 in the pipeline is test_pipeline.py's digits run.
  for name, precision, extra in (
      ("pipeline", "mixed_bfloat16", dict(
          mode="pipeline", num_devices=2, num_stages=2, num_microbatches=4)),
      # One worker: async is then sequential SGD, so deterministic: the
      # check sees the precision and not the noise of thread interleaving
      # (float32 async alone spreads over ~4 accuracy points here).
      ("async", "mixed_bfloat16", dict(mode="async", num_devices=2,
                                       async_workers=1)),
      ("async", "mixed_float16", dict(mode="async", num_devices=2,
                                      async_workers=1))):
    accuracy, summary = _accuracy(str(tmp_path / f"{name}_{precision}"),
                                  precision, **extra)
    # A pipeline step is a sync step, and so is a 1-worker async update.
    assert abs(accuracy - float32_accuracy) <= 0.01, (name, precision,
                                                      accuracy)
    if name == "async":
      assert summary["async_applied"] == DIGITS["train_steps"]


def _overflow_skips_the_step_on_every_replica(trainer):
  """On a float16 sync trainer of 2 replicas that has trained: an injected
  overflow skips the next step on both."""
  assert trainer.model.layers[1].compute_dtype == "float16"
  assert trainer.model.trainable_variables[0].dtype == "float32"
  # Finite steps: applied.
  assert int(trainer.optimizer.iterations.numpy()) == DIGITS["train_steps"]
  before = replica_copies(trainer)
  # Inject an overflow: scaled by 2**40, float16 gradients become inf.
  scales = trainer.strategy.experimental_local_results(
      trainer.loss_scale.scale)
  for copy in scales:
    copy.assign(2.0 ** 40)
  metrics = trainer.train(1)
  assert metrics["train/skipped_steps"] == 1
  assert metrics["train/loss_scale"] == 2.0 ** 39  # Halved ...
  assert [c.numpy() for c in scales] == [2.0 ** 39] * 2  # ... everywhere.
  for b, a in zip(before, replica_copies(trainer)):  # No replica applied it.
    for rb, ra in zip(b, a):
      np.testing.assert_array_equal(rb, ra)
  assert int(trainer.optimizer.iterations.numpy()) == DIGITS["train_steps"]
  # The step happened; its update not.
  assert int(trainer.step.numpy()) == DIGITS["train_steps"] + 1


def test_loss_scale_grows_after_good_steps():
  strategy = tf.distribute.get_strategy()
  with strategy.scope():
    ls = DynamicLossScale(initial_scale=8.0, growth_interval=2)

  @tf.function(autograph=False)
  def step(ok):
    strategy.run(ls.update, args=(ok,))

  step(tf.constant(True))
  assert ls.scale.numpy() == 8.0
  step(tf.constant(True))
  assert ls.scale.numpy() == 16.0 and ls.good_steps.numpy() == 0
  step(tf.constant(False))
  assert ls.scale.numpy() == 8.0


def test_modes_refuse_what_they_cannot_do(small_config):
  others = [m for m in MODES.names() if not MODES.get(m).grad_accumulation]
  assert others and "sync" not in others
  for mode in others:
    with pytest.raises(UserError, match="--grad_accum_steps"):
      configure.validate(small_config(mode=mode, grad_accum_steps=2),
                         Cluster())
  # Every built-in mode runs every precision; a mode that does not opt in
  # (an extension, say) is refused at the door.
  for mode in ("sync", "pipeline", "async", "ps"):
    assert set(MODES.get(mode).precisions) == set(PRECISIONS), mode

  class Float32Only(Trainer):  # pylint: disable=abstract-method
    pass

  with pytest.raises(UserError, match="--precision=mixed_float16"):
    Float32Only.check_capabilities(small_config(precision="mixed_float16"))
