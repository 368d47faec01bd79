"""The byte-level Transformer in every in-process mode.

Each mode is compared with single-device sync on the same tiny model and the
same byte windows: sync on two devices accumulating two batches (one run
for both equivalences), pipeline (K=4, one layer per stage, and R=2 x K=2),
async with one worker and local SGD with H=1 must reach the same variables
to 1e-5 (the async run's metric tail is checked too: test_metric_tail.py's
real run); mixed_bfloat16 must train (mixed_float16 is test_transformer.py's
short run). The Transformer stresses what the MLP
does not: an embedding lookup (its gradient is dense here), layer norms,
attention, and the language-model task's per-token loss. One block is
enough for all of it (more blocks repeat the same ops); the pipelines cut
the model explicitly and their planner times layers eagerly, since planning
is test_pipeline_v2.py's. The equivalences train with SGD, whose update is
the gradient itself (Adam's first steps normalise a wrong gradient scale
away), against one single-device reference; Adam's slots across stages
and accumulated steps are test_pipeline.py's and
test_sync_equivalence.py's, on the MLP.
"""

import math

import keras
import numpy as np
import pytest

from conftest import max_diff
from helpers import load_data
from dist_loop import configure, make_config
from dist_loop.parallel.modes import build_trainer
from dist_loop.runtime import devices
from dist_loop.runtime.cluster import Cluster

STEPS = 3
TOLERANCE = 1e-5
LOCAL = Cluster()
TINY = dict(model="transformer", num_layers=1, d_model=16, num_heads=2,
            mlp_ratio=2, seq_len=8)
LM_NAMES = {"train/loss", "train/accuracy", "train/bits_per_byte",
            "train/grad_norm", "train/skipped_steps",
            "train/skipped_steps_at_end"}


# Pipelines plan from eagerly timed layer costs (conftest.py).
pytestmark = pytest.mark.usefixtures("eager_costs")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A small text file with structure (repeated words), about 16 KB."""
  words = ["alpha", "beta", "gamma", "delta", "pipeline", "stage", "byte"]
  rng = np.random.RandomState(0)
  text = " ".join(words[i] for i in rng.randint(0, len(words), 2800))
  path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
  path.write_text(text)
  return str(path)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return tmp_path_factory.mktemp("transformer_modes")


def config(corpus, workdir, name, **overrides):
  flat = dict(workdir=str(workdir / name), dataset="text", data_file=corpus,
              num_devices=1, global_batch_size=16, train_steps=STEPS,
              optimizer="sgd", learning_rate=0.5, steps_per_loop=STEPS,
              log_every=STEPS, eval_every=STEPS, checkpoint_every=STEPS,
              seed=0, **TINY)
  flat.update(overrides)
  return configure.validate(make_config(**flat), LOCAL)


def trained(cfg, steps=STEPS):
  """(initial variables, final variables, metrics of the last call)."""
  names = devices.configure(cfg.num_devices, "cpu")
  keras.utils.set_random_seed(cfg.seed)
  trainer = build_trainer(cfg, names, load_data(cfg), LOCAL)
  try:
    start = [np.asarray(v) for v in trainer.model.trainable_variables]
    metrics = trainer.train(steps)
    end = [np.asarray(v) for v in trainer.model.trainable_variables]
    return start, end, metrics
  finally:
    trainer.close()


@pytest.fixture(scope="module")
def sgd_sync(corpus, workdir):
  start, end, _ = trained(config(corpus, workdir, "sync_sgd"))
  assert max_diff(end, start) > 1e-3
  return end


def test_two_devices_accumulating_equal_one_device_of_the_doubled_batch(
    corpus, workdir, sgd_sync):
  # Two accumulated batches of 8, each cut over 2 replicas, make one update
  # of the 16 examples that one device takes at once.
  _, end, _ = trained(config(corpus, workdir, "sync2_accum", num_devices=2,
                             global_batch_size=8, grad_accum_steps=2))
  assert max_diff(sgd_sync, end) <= TOLERANCE


# K=4 cuts the 4 layers one per stage: embed | block_0 | final_norm | head.
# K=2 (embed+block_0 | final_norm+head) runs as two replicas of it, with
# GPipe.
def test_pipeline_of_four_stages_equals_single_device_sync(corpus, workdir,
                                                           sgd_sync):
  cfg = config(corpus, workdir, "pipe4", mode="pipeline", num_devices=4,
               num_stages=4, num_microbatches=2, pipeline_schedule="1f1b",
               pipeline_timing="never", stage_split="explicit",
               split_points="1,2,3")
  _, end, metrics = trained(cfg)
  assert max_diff(sgd_sync, end) <= TOLERANCE
  assert metrics["train/skipped_steps"] == 0


def test_hybrid_two_pipelines_of_two_stages_equal_sync(corpus, workdir,
                                                       sgd_sync):
  cfg = config(corpus, workdir, "hybrid", mode="pipeline", num_devices=4,
               num_stages=2, num_microbatches=2, pipeline_schedule="gpipe",
               pipeline_timing="never", stage_split="explicit",
               split_points="2")
  _, end, metrics = trained(cfg)
  assert math.isfinite(metrics["train/loss"])
  assert metrics["train/skipped_steps"] == 0
  # Two replicas of two stages sum the same gradients as one device.
  assert max_diff(sgd_sync, end) <= TOLERANCE


def test_async_one_worker_equals_sync_sgd(corpus, workdir, sgd_sync):
  cfg = config(corpus, workdir, "async", mode="async", async_workers=1)
  _, end, metrics = trained(cfg)
  assert max_diff(sgd_sync, end) <= TOLERANCE
  # Its metric tail (`modes/base.py: train_metrics`, test_metric_tail.py):
  # the language model's names and no others, bits per byte from the loss.
  assert LM_NAMES <= set(metrics)
  assert not any(k.startswith("train/") for k in set(metrics) - LM_NAMES)
  assert metrics["train/bits_per_byte"] == (metrics["train/loss"]
                                            / math.log(2.0))
  assert metrics["train/skipped_steps"] == 0.0


def test_local_sgd_h1_average_lr1_equals_sync(corpus, workdir, sgd_sync):
  cfg = config(corpus, workdir, "local", mode="local_sgd", num_devices=2,
               sync_every=1)
  _, end, _ = trained(cfg)
  assert max_diff(sgd_sync, end) <= TOLERANCE


def test_mixed_bfloat16_trains(corpus, workdir):
  """mixed_float16 (with its loss scale) is test_transformer.py's short
  run, which learns more than byte frequencies."""
  precision = "mixed_bfloat16"
  cfg = config(corpus, workdir, precision, precision=precision,
               optimizer="adam", learning_rate=0.01, steps_per_loop=8)
  names = devices.configure(cfg.num_devices, "cpu")
  keras.utils.set_random_seed(cfg.seed)
  trainer = build_trainer(cfg, names, load_data(cfg), LOCAL)
  try:
    first = trainer.train(1)
    last = trainer.train(8)
  finally:
    trainer.close()
  assert math.isfinite(first["train/loss"]) and math.isfinite(
      last["train/loss"])
  # From about ln 256 = 5.5 nats; byte frequencies alone are worth more.
  assert last["train/loss"] < first["train/loss"] - 0.5, (first, last)
