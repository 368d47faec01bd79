"""The pipeline mode against single-device sync, and its checks at the door.

A pipelined step sums the gradients of M micro-batches (and, in hybrid mode,
of R replicas) and applies them once, so after any number of steps the
variables must equal those of single-device sync at the same global batch.
This catches a micro-batch gradient dropped or counted twice, a loss scaled
to the micro-batch instead of the global batch, a stage reading stale
variables, and a replica left out of the reduction.
"""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import max_diff, trained_variables
from dist_loop import train
from dist_loop.errors import UserError
from dist_loop.modes.pipeline import PipelineTrainer

STEPS = 6
TOLERANCE = 1e-5




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
