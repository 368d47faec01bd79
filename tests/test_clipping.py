"""The recipe in every mode: one reference, every way of computing it.

The full recipe (AdamW with `--weight_decay`, warm-up and cosine decay, and
a `--clip_global_norm` small enough that clipping acts on every step) on
one device is the reference, and each mode must reach the same variables
and report the same unclipped `train/grad_norm`: sync on two devices with
two accumulated micro-batches each (the norm after the all-reduce), each `--shard` stage (the norm from the
shards' squared norms, one more scalar all-reduce), the pipeline (the norm
across its stages), local SGD at H=1 on one replica (clipping per inner
step) and async with one worker (clipping per push; its step is the applied
updates, so the schedule gives it the same rates). `train/clipped_fraction`
is 1 in each. The ps mode clips per push on its workers with the same
`Recipe.clip` (`tests/test_ps.py`'s multi-process run, clipped on every
push); its locked update's rate is tested in process.
"""

import numpy as np
import pytest
import tensorflow as tf

import dist_loop.parallel.modes.local_sgd  # noqa: F401  (registers the mode)
from conftest import max_diff
from dist_loop import make_config
from dist_loop.core import options as options_lib
from dist_loop.parallel import staleness
from dist_loop.parallel.modes.ps import stats, update
from dist_loop.training import optim
from helpers import make_trainer, variables

STEPS = 6
CLIP = 0.05
RECIPE = dict(dataset="synthetic", model="mlp", global_batch_size=32,
              train_steps=STEPS, steps_per_loop=3, seed=0,
              optimizer="adamw", learning_rate=0.01, weight_decay=0.1,
              lr_schedule="cosine", warmup_steps=2, lr_final_fraction=0.1,
              clip_global_norm=CLIP)
MODES = {
    # 2 replicas x 2 accumulated micro-batches of 8: the same 32 examples.
    "sync_2_accum": dict(num_devices=2, grad_accum_steps=2,
                         global_batch_size=16),
    "optimizer": dict(num_devices=2, shard="optimizer"),
    "gradients": dict(num_devices=2, shard="gradients"),
    "weights": dict(num_devices=2, shard="weights"),
    "pipeline": dict(mode="pipeline", num_devices=2, num_stages=2,
                     num_microbatches=2, deterministic=True),
    "local_sgd": dict(mode="local_sgd", num_devices=1, sync_every=1),
    "async": dict(mode="async", num_devices=1, async_workers=1),
}


def _run(workdir, **flat):
  """(variables, metrics of the second call) after STEPS steps."""
  trainer = make_trainer(make_config(workdir=str(workdir),
                                     **{**RECIPE, **flat}))
  try:
    trainer.train(STEPS // 2)
    metrics = trainer.train(STEPS - STEPS // 2)
    return variables(trainer), metrics
  finally:
    trainer.close()


@pytest.fixture(name="reference", scope="module")
def _reference(tmp_path_factory):
  return _run(tmp_path_factory.mktemp("clip_reference"), num_devices=1)


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_clips_the_whole_reduced_gradient_alike(
    reference, tmp_path, mode):
  ref_vars, ref_metrics = reference
  assert ref_metrics["train/clipped_fraction"] == 1.0
  assert ref_metrics["train/grad_norm"] > 10 * CLIP  # Unclipped.
  run_vars, metrics = _run(tmp_path, **MODES[mode])
  assert max_diff(ref_vars, run_vars) <= 1e-6
  assert metrics["train/clipped_fraction"] == 1.0
  norm = ("local_sgd/replica_grad_norm" if mode == "local_sgd"
          else "train/grad_norm")
  assert metrics[norm] == pytest.approx(
      ref_metrics["train/grad_norm"], rel=1e-4)


def test_clipping_scales_to_the_bound_and_leaves_a_small_gradient():
  grads = [tf.constant([3.0, 0.0]), tf.constant([[4.0]])]
  norm = tf.linalg.global_norm(grads)  # 5
  clipped, acted = optim.clip_by_global_norm(grads, norm, 1.0)
  assert bool(acted)
  np.testing.assert_allclose(
      float(tf.linalg.global_norm(clipped)), 1.0, rtol=1e-6)
  np.testing.assert_allclose(clipped[0], [0.6, 0.0], rtol=1e-6)
  same, acted = optim.clip_by_global_norm(grads, norm, 10.0)
  assert not bool(acted)
  for a, b in zip(same, grads):  # Multiplied by exactly 1.
    np.testing.assert_array_equal(a, b)


def test_the_largest_clip_norm_leaves_the_gradient_finite():
  """--clip_global_norm's bound (options.MAX_FLOAT) still computes in
  float32: above it, clip / max(norm, clip) was inf / inf = NaN."""
  grads = [tf.constant([3.0, 0.0]), tf.constant([[4.0]])]
  norm = tf.linalg.global_norm(grads)
  same, acted = optim.clip_by_global_norm(grads, norm, options_lib.MAX_FLOAT)
  assert not bool(acted)
  for a, b in zip(same, grads):
    np.testing.assert_array_equal(a, b)


def test_weight_decay_skips_biases_and_is_decoupled():
  """A zero gradient: SGD moves a kernel by lr x wd x w only, and leaves
  a bias (rank 1) alone; -1 keeps the optimizer's own decay (AdamW's)."""
  kernel = tf.Variable(np.ones((2, 2), np.float32))
  bias = tf.Variable(np.ones(2, np.float32))
  sgd = optim.make("sgd", 0.1, [kernel, bias], weight_decay=0.5)
  optim.apply_reduced(sgd, [tf.zeros((2, 2)), tf.zeros(2)], [kernel, bias],
                      tf.constant(True), learning_rate=tf.constant(0.2))
  np.testing.assert_allclose(kernel.numpy(), 1.0 - 0.2 * 0.5, rtol=1e-6)
  np.testing.assert_array_equal(bias.numpy(), 1.0)
  assert optim.make("adamw", 0.1, [kernel]).weight_decay == 0.004
  assert optim.make("sgd", 0.1, [kernel]).weight_decay is None
  assert optim.make("adamw", 0.1, [kernel], weight_decay=0.0
                    ).weight_decay is None


def test_the_ps_update_applies_the_rate_of_the_step_it_makes():
  """The ps mode's locked update, in process: the update that takes `step`
  from s to s + 1 is applied at `rate(s)` (`Recipe.rate`), whatever the
  optimizer's rate variable holds, and writes that rate into it."""
  layout = stats.Layout(("loss",))
  w = tf.Variable([1.0, 2.0])
  step = tf.Variable(3, dtype=tf.int64)
  sgd = optim.make("sgd", 123.0, [w])
  locked = update.LockedUpdate(
      optimizer=sgd, variables=[w], step=step,
      stats=tf.Variable(tf.zeros([layout.size], tf.float64)), layout=layout,
      max_staleness=staleness.NO_BOUND,
      rate=lambda s: tf.cast(s + 1, tf.float32) / 8.0)
  offer = tf.function(lambda: locked(
      [tf.ones(2)], step.read_value(), tf.constant(10, tf.int64),
      {"loss": tf.constant(1.0), "grad_norm": tf.constant(1.0)},
      tf.constant(1.0)), autograph=False)
  assert offer()["applied"] and offer()["applied"]
  # Steps 4 and 5: 0.5 + 0.625.
  np.testing.assert_allclose(w.numpy(), [1.0 - 1.125, 2.0 - 1.125])
  assert float(sgd.learning_rate) == 0.625
