"""The synchronous step: one compressed all-reduce, no retracing, resume,
non-finite detection, convergence."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import checkpoint_variables
from dist_loop import train
from dist_loop.data.base import DATASETS, Dataset
from dist_loop.errors import NonFiniteError
from dist_loop.modes import sync



def _spy_all_reduce(monkeypatch):
  """Records the dtypes of every tensor that reaches ReplicaContext.all_reduce."""
  seen = []
  original = tf.distribute.ReplicaContext.all_reduce

  def spy(self, reduce_op, value, options=None):
    seen.append([t.dtype for t in tf.nest.flatten(value)])
    return original(self, reduce_op, value, options=options)

  monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", spy)
  return seen


def test_bf16_compression_reaches_the_reduce_and_still_converges(
    small_config, monkeypatch):
  seen = _spy_all_reduce(monkeypatch)
  cfg = small_config(dataset="digits", model="mlp", num_devices=2,
                     optimizer="adam", learning_rate=0.01, train_steps=200,
                     global_batch_size=64, steps_per_loop=50, log_every=100,
                     eval_every=200, checkpoint_every=200,
                     allreduce_compression="bf16",
                     allreduce_bytes_per_pack=4096)
  summary = train.run(cfg)
  # One all-reduce call per traced replica step (2 replicas trace it), and
  # every gradient in it is bf16 on the wire.
  assert len(seen) == 2
  assert all(d == tf.bfloat16 for call in seen for d in call)
  assert len(seen[0]) == 4  # kernel+bias of two Dense layers, in one call.
  assert summary["eval_accuracy"] > 0.9


def test_without_compression_the_reduce_sees_float32(small_config,
                                                     monkeypatch):
  seen = _spy_all_reduce(monkeypatch)
  train.run(small_config(num_devices=2, train_steps=5))
  assert seen and all(d == tf.float32 for call in seen for d in call)


def test_step_function_is_traced_once_per_run(small_config, monkeypatch):
  counts = []
  original = sync.SyncTrainer.close

  def record(self):
    counts.append(self.trace_count)
    original(self)

  monkeypatch.setattr(sync.SyncTrainer, "close", record)
  # Loops of 5, 3 (to the log boundary at 8) and 2 steps: different lengths,
  # still one trace.
  train.run(small_config(num_devices=2, train_steps=13, steps_per_loop=5,
                         log_every=8, eval_every=13, checkpoint_every=13))
  assert counts == [1]


def test_resume_equals_uninterrupted(small_config, tmp_path):
  common = dict(num_devices=2, optimizer="adam", learning_rate=0.01,
                checkpoint_every=100, eval_every=100, log_every=3,
                steps_per_loop=3)
  whole = small_config(workdir=str(tmp_path / "whole"), train_steps=12,
                       **common)
  train.run(whole)
  parts = small_config(workdir=str(tmp_path / "parts"), train_steps=6,
                       **common)
  train.run(parts)  # Saves a checkpoint at its last step, 6.
  summary = train.run(parts.replace(train_steps=12))
  assert summary["final_step"] == 12
  a, b = checkpoint_variables(whole), checkpoint_variables(parts.replace(train_steps=12))
  assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) <= 1e-6


def test_rerun_of_a_finished_run_trains_nothing(small_config):
  cfg = small_config(train_steps=5)
  train.run(cfg)
  before = checkpoint_variables(cfg)
  summary = train.run(cfg)
  assert summary["final_step"] == 5
  after = checkpoint_variables(cfg)
  assert all(np.array_equal(x, y) for x, y in zip(before, after))


@DATASETS.register("test_nan")
def _nan_dataset(data_dir, seed, image_size=None):
  del data_dir, seed, image_size
  x = np.full((64, 10), np.nan, np.float32)
  y = np.zeros(64, np.int32)
  return Dataset(x, y, x[:8], y[:8], 10)


def test_non_finite_loss_stops_and_names_the_step(small_config):
  cfg = small_config(dataset="test_nan", num_devices=2, train_steps=10)
  with pytest.raises(NonFiniteError, match="at step 1"):
    train.run(cfg)
  # No checkpoint with NaNs was written, and the bad update was not applied.
  assert not os.path.exists(os.path.join(cfg.workdir, "checkpoints",
                                         "checkpoint"))


def test_summary_json_and_flags(small_config):
  cfg = small_config(train_steps=10)
  train.run(cfg, flags_text="--train_steps=10\n")
  with open(os.path.join(cfg.workdir, "summary.json")) as f:
    summary = json.load(f)
  for key in ("final_step", "train_loss", "eval_loss", "eval_accuracy",
              "examples_per_sec", "wall_time_s"):
    assert summary[key] is not None, key
  assert summary["final_step"] == 10
  with open(os.path.join(cfg.workdir, "flags.txt")) as f:
    assert f.read() == "--train_steps=10\n"
