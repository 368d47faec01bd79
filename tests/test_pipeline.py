"""The pipeline mode against single-device sync, and its checks at the door.

A pipelined step sums the gradients of M micro-batches (and, in hybrid mode,
of R replicas) and applies them once, so after any number of steps the
variables must equal those of single-device sync at the same global batch.
This catches a micro-batch gradient dropped or counted twice, a loss scaled
to the micro-batch instead of the global batch, a stage reading stale
variables, a replica left out of the reduction, and a stage's
regularisation counted other than once per step.

Trainers run in this process, outside the controller, on explicit splits
(the timed split depends on machine load); one test goes through
`train.run` and reads what it leaves behind.
"""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import max_diff
from helpers import load_data
from dist_loop import configure, data, make_config, train
from dist_loop.core.errors import UserError
from dist_loop.data import Dataset
from dist_loop.models import MODELS
from dist_loop.parallel.modes import build_trainer
from dist_loop.parallel.modes.pipeline import PipelineTrainer
from dist_loop.runtime import checkpoints, devices
from dist_loop.runtime.cluster import Cluster

STEPS = 6
TOLERANCE = 1e-5
LOCAL = Cluster()
FP16 = dict(precision="mixed_float16")
# K=2 stages (flatten+dense | logits) of M=4 micro-batches of 8; or 2
# replicas of them, M=2 each. Untimed: one traced loop (timing is tested in
# test_pipeline_v2.py).
K2 = dict(mode="pipeline", num_devices=2, num_stages=2, num_microbatches=4,
          stage_split="explicit", split_points="2", pipeline_timing="never")
R2K2 = dict(K2, num_devices=4, num_microbatches=2)


# Pipelines plan from eagerly timed layer costs (conftest.py).
pytestmark = pytest.mark.usefixtures("eager_costs")


@MODELS.register("test_regularized_mlp")
def _regularized_mlp(input_shape, num_classes):
  """Weight and activity regularisers on the first and last stage of a
  3-stage split (1,2); the middle stage has none and passes the term on."""
  del input_shape
  l2 = keras.regularizers.L2
  return [
      keras.layers.Dense(32, activation="relu", kernel_regularizer=l2(0.05),
                         activity_regularizer=l2(0.01), name="dense_a"),
      keras.layers.Dense(32, activation="relu", name="dense_b"),
      keras.layers.Dense(num_classes, kernel_regularizer=l2(0.05),
                         name="logits"),
  ]


def config(name, tmp_path, **overrides):
  """A validated Config of the tiny task (adam: optimizer slots matter)."""
  flat = dict(workdir=str(tmp_path / name), dataset="synthetic", model="mlp",
              num_devices=1, global_batch_size=32, train_steps=STEPS,
              optimizer="adam", learning_rate=0.01, steps_per_loop=3,
              log_every=3, eval_every=STEPS, checkpoint_every=STEPS, seed=0)
  flat.update(overrides)
  return configure.validate(make_config(**flat), LOCAL)


def build(cfg, dataset=None):
  """The config's trainer, seeded as `train.run` seeds it."""
  names = devices.configure(cfg.num_devices, "cpu")
  keras.utils.set_random_seed(cfg.seed)
  return build_trainer(cfg, names, dataset or load_data(cfg), LOCAL)


def weights(trainer):
  return [v.numpy() for v in trainer.model.trainable_variables]


def trained(cfg, steps=STEPS):
  """(variables, metrics) after `steps` steps in one inner loop."""
  trainer = build(cfg)
  try:
    metrics = trainer.train(steps)
    assert int(trainer.step.numpy()) == steps
    return weights(trainer), metrics
  finally:
    trainer.close()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
  return tmp_path_factory.mktemp("pipeline")


def save(trainer):
  """A checkpoint of the trainer's state in its workdir."""
  checkpoints.Checkpointer(trainer.checkpoint_items(), trainer.config.workdir,
                           1).save(int(trainer.step.numpy()))


@pytest.fixture(scope="module")
def sync_run(tmp):
  """Single-device sync's variables after STEPS steps, in two loops, and
  the second loop's metrics; its checkpoint of step STEPS // 2 is in
  tmp/sync."""
  trainer = build(config("sync", tmp))
  start = weights(trainer)
  trainer.train(STEPS // 2)
  save(trainer)
  metrics = trainer.train(STEPS - STEPS // 2)
  reference = weights(trainer)
  trainer.close()
  # Training moved the variables well beyond the tolerance, so equality
  # with the reference is not two untouched initialisations.
  assert max_diff(reference, start) > 1e-2
  return reference, metrics


@pytest.fixture(scope="module")
def sync_reference(sync_run):
  return sync_run[0]


def assert_same_metrics(metrics, reference):
  """The names sync returns, and (all from the same updates) its values."""
  assert set(metrics) == set(reference)
  for name, value in reference.items():
    assert metrics[name] == pytest.approx(value, rel=1e-4, abs=TOLERANCE), (
        name)


# -- a step equals a single-device sync step --

# 1F1B recomputing every stage, timed from its first step (GPipe without
# recompute, from sync's checkpoint, is test_checkpoints_interchange_with_sync;
# the other settings are in the regularised and float16 tests below (1F1B
# without recompute, K=3, and hybrid) and test_pipeline_v2.py's; the
# timed step (its timestamps and their control edges) must not change what
# a step computes.
# Its timed steps also report the measured bubble and timeline.
def test_pipeline_equals_single_device_sync(tmp, sync_run):
  trainer = build(config(
      "pipe_1f1b_always", tmp, pipeline_schedule="1f1b",
      recompute="always", **dict(K2, pipeline_timing="every")))
  before = trainer.report()  # Only the prediction before any step.
  assert "pipeline/bubble_measured" not in before.scalars
  # In two loops, as the reference: the metrics are the second's.
  trainer.train(STEPS // 2)
  metrics = trainer.train(STEPS - STEPS // 2)
  assert int(trainer.step.numpy()) == STEPS
  assert max_diff(sync_run[0], weights(trainer)) <= TOLERANCE
  assert metrics["train/skipped_steps"] == 0
  assert set(metrics) == {"train/loss", "train/accuracy", "train/grad_norm",
                          "train/skipped_steps", "train/skipped_steps_at_end"}
  assert_same_metrics(metrics, sync_run[1])
  report = trainer.report()
  assert set(report.scalars) == {
      "pipeline/bubble_measured", "pipeline/bubble_predicted",
      "pipeline/bubble_formula", "pipeline/step_ms",
      "pipeline/step_ms_predicted"}
  assert 0.0 <= report.scalars["pipeline/bubble_measured"] < 1.0
  assert 0.0 < report.scalars["pipeline/bubble_predicted"] < 1.0
  assert report.scalars["pipeline/step_ms"] > 0
  image = report.images["pipeline/timeline"]
  # The measured chart above the predicted one.
  assert image.dtype == np.uint8 and image.ndim == 3
  assert image.shape[0] > before.images["pipeline/timeline"].shape[0]
  trainer.train(1)  # Another loop length: the same trace.
  assert int(trainer.step.numpy()) == STEPS + 1
  assert trainer.trace_counts == {"timed": 1}
  trainer.close()


@pytest.fixture(scope="module")
def regularised_sync(tmp):
  return trained(config("reg_sync", tmp, model="test_regularized_mlp"))


# K=3 on an explicit split (1,2): the middle stage has no regulariser and
# passes the term on. A regularised model in R=2 x K=2 hybrid is
# test_pipeline_v2.py's (zb_h1 recomputing everything; its model's second
# layer has both regularisers); 1F1B in hybrid is the float16 hybrid test
# below.
def test_regularised_model_equals_sync(tmp, regularised_sync):
  sync_vars, sync_metrics = regularised_sync
  cfg = config("reg_pipe", tmp, model="test_regularized_mlp", **dict(
      K2, num_devices=3, num_stages=3, num_microbatches=2,
      split_points="1,2"))
  assert PipelineTrainer.num_replicas(cfg, LOCAL) == 1
  trainer = build(cfg)
  penalty = float(tf.add_n(trainer.model.losses))
  metrics = trainer.train(STEPS)
  # The loss includes the penalty, once: far more than the tolerance.
  assert penalty > 100 * TOLERANCE
  assert abs(metrics["train/loss"] - sync_metrics["train/loss"]) <= TOLERANCE
  assert max_diff(sync_vars, weights(trainer)) <= TOLERANCE
  trainer.close()


def test_checkpoints_interchange_with_sync(tmp, sync_run):
  # Sync trained half the steps (the reference's checkpoint); the pipeline
  # (GPipe, no recompute, M=K=2) resumes from it, saves at once, and trains the
  # rest, which equals sync's second loop, metrics too; sync resumes from
  # that save.
  def resumed(cfg, restore_from):
    trainer = build(cfg)
    assert checkpoints.Checkpointer(
        trainer.checkpoint_items(), restore_from, 1).restore(trainer.scope())
    assert int(trainer.step.numpy()) == STEPS // 2
    return trainer

  sync_reference = sync_run[0]
  pipe = resumed(config("s_then_p", tmp, pipeline_schedule="gpipe",
                        recompute="never", **dict(K2, num_microbatches=2)),
                 str(tmp / "sync"))
  save(pipe)
  metrics = pipe.train(STEPS // 2)
  assert int(pipe.step.numpy()) == STEPS
  s_then_p = weights(pipe)
  pipe.close()
  assert metrics["train/skipped_steps"] == 0
  assert_same_metrics(metrics, sync_run[1])
  sync = resumed(config("p_then_s", tmp), pipe.config.workdir)
  sync.train(STEPS // 2)
  p_then_s = weights(sync)
  sync.close()
  assert max_diff(sync_reference, s_then_p) <= TOLERANCE
  assert max_diff(sync_reference, p_then_s) <= TOLERANCE


# -- float16: one loss scale for every stage --

@pytest.fixture(scope="module")
def sync_fp16_reference(tmp, sync_reference):
  """Sync mixed_float16 on one device, summing the pipelines' micro-batches.

  float16 rounds each micro-batch's gradients, so summing other
  micro-batches than the pipeline's moves the result beyond fp32 round-off:
  the reference sums the same micro-batches (batches of 8, accumulated 4x).
  """
  reference, metrics = trained(config("sync_fp16", tmp, global_batch_size=8,
                                      grad_accum_steps=4, **FP16))
  assert max_diff(reference, sync_reference) > 10 * TOLERANCE
  return reference, metrics


def assert_same_as_fp16_sync(variables, metrics, sync_fp16_reference):
  reference, reference_metrics = sync_fp16_reference
  assert max_diff(reference, variables) <= TOLERANCE
  # The loss scale too: the same overflows were skipped.
  assert "train/loss_scale" in metrics
  assert set(metrics) == set(reference_metrics)
  assert metrics["train/loss_scale"] == reference_metrics["train/loss_scale"]
  assert metrics["train/skipped_steps"] == reference_metrics[
      "train/skipped_steps"]


def test_fp16_hybrid_equals_sync_restores_in_sync_and_skips_an_overflow(
    tmp, sync_fp16_reference):
  # R=2 x K=2 (float16 on one pipeline, K=2 alone, is the digits run below:
  # the same stages without the replicas' reduction).
  trainer = build(config("fp16_r2k2", tmp, **R2K2, **FP16))
  assert trainer.model.layers[1].compute_dtype == "float16"
  metrics = trainer.train(STEPS)  # Finite steps: applied.
  assert_same_as_fp16_sync(weights(trainer), metrics, sync_fp16_reference)
  applied = int(trainer.optimizer.iterations.numpy())
  assert applied == STEPS - metrics["train/skipped_steps"]
  # Its checkpoint, loss scale included, restores in sync.
  trainer.loss_scale.scale.assign(2.0 ** 20)  # Not what sync starts at.
  workdir = trainer.config.workdir
  checkpoints.Checkpointer(trainer.checkpoint_items(), workdir, 1).save(STEPS)
  sync = build(config("fp16_r2k2", tmp, **FP16))
  assert checkpoints.Checkpointer(sync.checkpoint_items(), workdir, 1).restore(
      sync.scope()) is not None
  assert sync.loss_scale.scale.numpy() == 2.0 ** 20
  assert max_diff(weights(trainer), weights(sync)) == 0
  sync.close()
  before = weights(trainer)
  # Inject an overflow: scaled by 2**40, float16 gradients become inf.
  trainer.loss_scale.scale.assign(2.0 ** 40)
  metrics = trainer.train(1)
  assert metrics["train/skipped_steps"] == 1
  assert metrics["train/skipped_steps_at_end"] == 1
  assert "train/loss" not in metrics  # No update: no loss, never a 0.
  assert metrics["train/loss_scale"] == 2.0 ** 39
  for b, v in zip(before, weights(trainer)):
    np.testing.assert_array_equal(b, v)  # No stage applied it.
  assert int(trainer.optimizer.iterations.numpy()) == applied
  # The step happened; its update not.
  assert int(trainer.step.numpy()) == STEPS + 1
  trainer.close()


# -- the shared inner loop: a non-finite step is skipped --

def test_nonfinite_skip_drops_the_step(tmp):
  synthetic = data.DATASETS.get("synthetic")(None, 0, None)
  # Two batches an epoch, and example 0 is NaN: one step of each two.
  x, y = synthetic.train_x[:64].copy(), synthetic.train_y[:64]
  x[0] = np.nan
  nan = Dataset(x, y, synthetic.eval_x, synthetic.eval_y,
                synthetic.num_classes)
  trainer = build(config("skip", tmp, nonfinite="skip",
                         **dict(K2, num_microbatches=2)), nan)
  metrics = trainer.train(4)
  assert metrics["train/skipped_steps"] == 2
  assert int(trainer.step.numpy()) == 4
  assert int(trainer.optimizer.iterations.numpy()) == 2
  assert all(np.isfinite(v).all() for v in weights(trainer))
  assert np.isfinite(metrics["train/loss"])
  trainer.close()


# -- placement, metrics and reporting --

def test_stages_live_on_their_devices_and_predict_the_bubble(tmp):
  # Built, not trained: what a timed step measures is checked on the
  # trainer of test_pipeline_equals_single_device_sync.
  trainer = build(config("placed", tmp, mode="pipeline", model="cnn",
                         num_devices=2, num_stages=2, num_microbatches=2,
                         global_batch_size=8, pipeline_timing="every"))
  # The seed CNN's own split: conv+pool | flatten+dense+dense.
  assert [s.layer_names for s in trainer.chunk_spans] == [
      ("conv", "pool"), ("flatten", "dense_1", "logits")]
  for var in trainer.model.trainable_variables:
    stage = 0 if var.path.startswith("conv") else 1
    assert var.value.device.endswith(f"CPU:{stage}"), var.path
  before = trainer.report()  # Only the prediction before any step.
  assert "pipeline/bubble_measured" not in before.scalars
  assert before.scalars["pipeline/bubble_formula"] == pytest.approx(1 / 3)
  assert 0.0 < before.scalars["pipeline/bubble_predicted"] < 1.0
  assert trainer.summary()["pipeline_split"] == [
      ["conv", "pool"], ["flatten", "dense_1", "logits"]]
  trainer.close()


def test_fp16_pipeline_reaches_float32_accuracy_and_logs_its_timeline(tmp):
  # Float32 sync reaches 0.972 here (150 steps of 64 on digits, seeds 0
  # and 1); float16 in the pipeline must come within 0.01 of it.
  common = dict(dataset="digits", global_batch_size=64, train_steps=150,
                steps_per_loop=50, log_every=50, eval_every=150,
                checkpoint_every=150)
  # The default timing: only the step at each log line is timed.
  cfg = config("digits_fp16", tmp, **dict(K2, pipeline_timing="log"), **FP16,
               **common)
  summary = train.run(cfg)
  assert summary["eval_accuracy"] >= 0.962, summary
  assert summary["pipeline_stages"] == 2
  tags = set()
  for path in glob.glob(os.path.join(cfg.workdir, "tb", "**",
                                     "events.out.tfevents.*"), recursive=True):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(v.tag for v in event.summary.value)
  assert {"pipeline/timeline", "pipeline/bubble_measured",
          "pipeline/bubble_predicted", "pipeline/bubble_formula",
          "pipeline/step_ms"} <= tags


# -- checks at the door --

@pytest.mark.parametrize("overrides,message", [
    (dict(num_stages=3, num_devices=2), r"--num_stages=3 needs 3 devices"),
    (dict(num_stages=2, num_devices=3), r"not a multiple of --num_stages=2"),
    (dict(num_microbatches=5), r"--num_microbatches=5 does not divide the "
                               r"per-replica batch 32.*use --num_microbatches"),
    (dict(num_devices=4, num_microbatches=32),
     r"does not divide the per-replica batch 16 .*over 2 replica"),
    (dict(global_batch_size=33, num_devices=4), r"not divisible by 2"),
    (dict(stage_split="explicit", split_points="3"),
     r"out of range: the model has 3 layers.*1\.\.2"),
    (dict(stage_split="explicit", split_points="0"), r"out of range"),
    (dict(stage_split="explicit"), r"needs --split_points"),
    (dict(split_points="1"), r"only read with --stage_split=explicit"),
    (dict(num_stages=4, num_devices=4), r"has 3 layers; use at most 3"),
    (dict(num_stages=0), r"--num_stages must be >= 1"),
    (dict(pipeline_schedule="zigzag"), r"unknown --pipeline_schedule"),
    (dict(recompute="sometimes"), r"unknown --recompute"),
    (dict(grad_accum_steps=2), r"--grad_accum_steps is not supported"),
])
def test_bad_configs_fail_at_the_door(tmp, overrides, message):
  with pytest.raises(UserError, match=message):
    config("bad", tmp, **{"mode": "pipeline", "num_devices": 2, **overrides})


def test_options_of_the_pipeline_are_refused_in_other_modes(tmp):
  with pytest.raises(UserError, match="--num_stages is an option of "
                                      "--mode=pipeline"):
    config("other", tmp, num_stages=2)
