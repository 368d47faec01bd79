"""The pipeline mode against single-device sync, and its checks at the door.

A pipelined step sums the gradients of M micro-batches (and, in hybrid mode,
of R replicas) and applies them once, so after any number of steps the
variables must equal those of single-device sync at the same global batch.
This catches a micro-batch gradient dropped or counted twice, a loss scaled
to the micro-batch instead of the global batch, a stage reading stale
variables, and a replica left out of the reduction.

Under mixed_float16 the stages share one dynamic loss scale: an overflow
anywhere skips the whole step, and a step equals sync's on the same
micro-batches.
"""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import max_diff, trained_variables
from dist_loop import checkpoints, data, devices, train
from dist_loop.errors import UserError
from dist_loop.modes import build_trainer
from dist_loop.modes.pipeline import PipelineTrainer

STEPS = 6
TOLERANCE = 1e-5
FP16 = dict(precision="mixed_float16")
# K=2 stages of M=4 micro-batches of 8; or 2 replicas of them, M=2 each.
PIPELINES = {"k2": dict(mode="pipeline", num_devices=2, num_stages=2,
                        num_microbatches=4),
             "r2k2": dict(mode="pipeline", num_devices=4, num_stages=2,
                          num_microbatches=2)}


@pytest.fixture(scope="module")
def make(tmp_path_factory):
  """Configs of one tiny task (adam, so optimizer slots matter too)."""
  from dist_loop import Config  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("pipeline")

  def config(name, **overrides):
    base = dict(workdir=str(root / name), dataset="synthetic", model="mlp",
                num_devices=1, global_batch_size=32, train_steps=STEPS,
                optimizer="adam", learning_rate=0.01, steps_per_loop=3,
                log_every=3, eval_every=STEPS, checkpoint_every=STEPS,
                seed=0)
    base.update(overrides)
    return Config(**base)

  return config


def build(config):
  """The config's trainer on synthetic data, outside the controller."""
  names = devices.configure(config.num_devices, "cpu")
  return build_trainer(config.validate(), names,
                       data.DATASETS.get("synthetic")(None, 0, None))


@pytest.fixture(scope="module")
def sync_reference(make):
  reference = trained_variables(make("sync"))
  # Training moved the variables well beyond the tolerance, so equality
  # with the reference is not two untouched initialisations.
  start = trained_variables(make("start", train_steps=1))
  assert max_diff(reference, start) > 1e-2
  return reference


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("recompute", ["never", "always"])
def test_pipeline_equals_single_device_sync(make, sync_reference, schedule,
                                            recompute):
  config = make(f"pipe_{schedule}_{recompute}", mode="pipeline",
                num_devices=2, num_stages=2, num_microbatches=4,
                pipeline_schedule=schedule, recompute=recompute)
  variables = trained_variables(config)
  assert max_diff(sync_reference, variables) <= TOLERANCE


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hybrid_two_replicas_of_two_stages_equals_sync(make, sync_reference,
                                                       schedule):
  config = make(f"hybrid_{schedule}", mode="pipeline", num_devices=4,
                num_stages=2, num_microbatches=4, pipeline_schedule=schedule,
                recompute="except_last")
  assert PipelineTrainer.num_replicas(config) == 2
  assert max_diff(sync_reference, trained_variables(config)) <= TOLERANCE


def test_hybrid_with_a_stage_without_variables_equals_sync(make,
                                                         sync_reference):
  # Stage 0 is the Flatten alone: it has no gradients to reduce over the
  # replicas. (The timed split can choose this too, under load.)
  config = make("hybrid_flatten", mode="pipeline", num_devices=4,
                num_stages=2, num_microbatches=2, stage_split="explicit",
                split_points="1")
  assert max_diff(sync_reference, trained_variables(config)) <= TOLERANCE


def test_three_stages_explicit_split_equals_sync(make, sync_reference):
  config = make("three", mode="pipeline", num_devices=3, num_stages=3,
                num_microbatches=2, stage_split="explicit",
                split_points="1,2")
  assert max_diff(sync_reference, trained_variables(config)) <= TOLERANCE


def test_checkpoints_interchange_with_sync(make, sync_reference):
  # Half in pipeline mode, then sync resumes the same workdir, and back.
  # (Resuming under another mode is a layout change the user must allow.)
  pipe = dict(mode="pipeline", num_devices=2, num_stages=2,
              num_microbatches=4)
  train.run(make("p_then_s", train_steps=STEPS // 2, **pipe))
  p_then_s = trained_variables(make("p_then_s", mode="sync", num_devices=2,
                                  allow_config_change=True))
  train.run(make("s_then_p", train_steps=STEPS // 2, num_devices=2))
  s_then_p = trained_variables(make("s_then_p", allow_config_change=True,
                                  **pipe))
  assert max_diff(sync_reference, p_then_s) <= TOLERANCE
  assert max_diff(sync_reference, s_then_p) <= TOLERANCE


def test_stages_live_on_their_devices_and_log_the_bubble(make):
  from dist_loop import data, devices  # pylint: disable=g-import-not-at-top
  config = make("placed", mode="pipeline", model="cnn", num_devices=2,
                num_stages=2, num_microbatches=2, global_batch_size=8)
  names = devices.configure(2, "cpu")
  split = data.DATASETS.get("synthetic")(None, 0, 28)
  trainer = PipelineTrainer(config, names, split)
  # The seed CNN's own split: conv+pool | flatten+dense+dense.
  assert [s.layer_names for s in trainer.stages] == [
      ("conv", "pool"), ("flatten", "dense_1", "logits")]
  for var in trainer.model.trainable_variables:
    stage = 0 if var.path.startswith("conv") else 1
    assert var.value.device.endswith(f"CPU:{stage}"), var.path
  metrics = trainer.train(2)
  assert int(trainer.step.numpy()) == 2
  assert set(metrics) >= {"train/loss", "train/accuracy", "train/grad_norm",
                          "train/learning_rate", "pipeline/bubble_measured",
                          "pipeline/bubble_formula"}
  assert metrics["pipeline/bubble_formula"] == pytest.approx(1 / 3)
  assert 0.0 <= metrics["pipeline/bubble_measured"] < 1.0
  image = trainer.images()["pipeline/timeline"]
  assert image.dtype == np.uint8 and image.ndim == 3
  trainer.train(1)  # Another loop length: the same trace.
  assert int(trainer.step.numpy()) == 3 and trainer.trace_count == 1


def test_timeline_image_reaches_tensorboard(make):
  config = make("tb", mode="pipeline", num_devices=2, num_stages=2,
                num_microbatches=2, train_steps=3)
  train.run(config)
  tags = set()
  for path in glob.glob(os.path.join(config.workdir, "tb", "*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(v.tag for v in event.summary.value)
  assert {"pipeline/timeline", "pipeline/bubble_measured",
          "pipeline/bubble_formula"} <= tags


@pytest.mark.parametrize("overrides,message", [
    (dict(num_stages=3, num_devices=2), r"--num_stages=3 needs 3 devices"),
    (dict(num_stages=2, num_devices=3), r"not a multiple of --num_stages=2"),
    (dict(num_microbatches=5), r"--num_microbatches=5 does not divide the "
                               r"per-replica batch 32.*use --num_microbatches"),
    (dict(num_devices=4, num_microbatches=32),
     r"does not divide the per-replica batch 16 .*over 2 replica"),
    (dict(stage_split="explicit", split_points="3"),
     r"out of range: the model has 3 layers.*1\.\.2"),
    (dict(stage_split="explicit", split_points="0"), r"out of range"),
    (dict(stage_split="explicit"), r"needs --split_points"),
    (dict(split_points="1"), r"only read with --stage_split=explicit"),
    (dict(num_stages=4, num_devices=4), r"has 3 layers; use at most 3"),
    (dict(pipeline_schedule="zigzag"), r"unknown --pipeline_schedule"),
    (dict(recompute="sometimes"), r"unknown --recompute"),
])
def test_bad_configs_fail_at_the_door(make, overrides, message):
  config = make("bad", **{"mode": "pipeline", "num_devices": 2, **overrides})
  with pytest.raises(UserError, match=message):
    config.validate()


@pytest.fixture(scope="module")
def sync_fp16_reference(make, sync_reference):
  """Sync mixed_float16 on one device, summing the pipelines' micro-batches.

  float16 rounds each micro-batch's gradients, so summing other micro-batches
  moves the result well beyond fp32 round-off. Measured after 6 steps
  against sync on whole batches of 32: micro-batches of 8 differ by 1.3e-3
  with adam (which turns tiny gradients into full steps) and 1.0e-5 with
  sgd; micro-batches of 4 by 7.8e-4 with sgd, in sync with accumulation as
  much as in the pipeline. So the reference sums the same micro-batches.
  """
  reference = trained_variables(make("sync_fp16", global_batch_size=8,
                                     grad_accum_steps=4, **FP16))
  # float16 did compute: far from the float32 run (measured 2.5e-3).
  assert max_diff(reference, sync_reference) > 10 * TOLERANCE
  return reference


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_fp16_pipeline_equals_sync_on_the_same_micro_batches(
    make, sync_fp16_reference, pipeline):
  # Measured: bit-identical (max diff 0.0) with gpipe and 1f1b.
  config = make(f"fp16_{pipeline}", **PIPELINES[pipeline], **FP16)
  assert max_diff(sync_fp16_reference, trained_variables(config)) <= TOLERANCE


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_fp16_overflow_skips_the_step_on_every_stage(make, pipeline):
  trainer = build(make(f"overflow_{pipeline}", **PIPELINES[pipeline], **FP16))
  assert trainer.model.layers[1].compute_dtype == "float16"
  trainer.train(2)  # Finite steps: applied.
  assert int(trainer.optimizer.iterations.numpy()) == 2
  before = [v.numpy() for v in trainer.model.trainable_variables]
  # Inject an overflow: scaled by 2**40, float16 gradients become inf.
  trainer.loss_scale.scale.assign(2.0 ** 40)
  metrics = trainer.train(1)
  assert metrics["train/skipped_steps"] == 1
  assert metrics["train/loss_scale"] == 2.0 ** 39
  for b, v in zip(before, trainer.model.trainable_variables):
    np.testing.assert_array_equal(b, v.numpy())  # No stage applied it.
  assert int(trainer.optimizer.iterations.numpy()) == 2
  assert int(trainer.step.numpy()) == 3  # The step happened; its update not.
  trainer.close()


def test_fp16_checkpoint_restores_in_sync_with_its_loss_scale(make):
  config = make("fp16_to_sync", **PIPELINES["k2"], **FP16)
  pipe = build(config)
  pipe.loss_scale.scale.assign(2.0 ** 20)
  checkpoints.manager(pipe.checkpoint_items(), config.workdir, 1).save(0)
  sync = build(make("fp16_to_sync", **FP16))
  mgr = checkpoints.manager(sync.checkpoint_items(), config.workdir, 1)
  assert checkpoints.restore_latest(mgr, sync.scope()) is not None
  assert sync.loss_scale.scale.numpy() == 2.0 ** 20
  assert max_diff([v.numpy() for v in pipe.model.trainable_variables],
                  [v.numpy() for v in sync.model.trainable_variables]) == 0
  sync.close()


def test_fp16_pipeline_reaches_float32_sync_accuracy(make):
  common = dict(dataset="digits", global_batch_size=64, train_steps=150,
                steps_per_loop=50, log_every=50, eval_every=150,
                checkpoint_every=150)
  f32 = train.run(make("digits_sync", **common))["eval_accuracy"]
  fp16 = train.run(make("digits_fp16", **PIPELINES["k2"], **FP16,
                        **common))["eval_accuracy"]
  assert f32 > 0.9
  assert abs(fp16 - f32) <= 0.01, (fp16, f32)
