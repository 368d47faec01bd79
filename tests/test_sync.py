"""The synchronous step: one all-reduce in the wire dtype, no retracing,
metrics, non-finite detection, resume."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import checkpoint_variables, max_diff
from dist_loop import train
from dist_loop.errors import NonFiniteError
from helpers import NAN_DATASET, make_trainer, replica_copies, variables


def _spy_all_reduce(monkeypatch):
  """Records the dtypes of what reaches `ReplicaContext.all_reduce`."""
  seen = []
  original = tf.distribute.ReplicaContext.all_reduce

  def spy(self, reduce_op, value, options=None):
    seen.append([t.dtype for t in tf.nest.flatten(value)])
    return original(self, reduce_op, value, options=options)

  monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", spy)
  return seen


def test_one_all_reduce_carries_every_gradient_in_the_wire_dtype(
    small_config, monkeypatch):
  """Loops of any length share one trace, and report the metrics."""
  seen = _spy_all_reduce(monkeypatch)
  trained = {}
  for compression, wire in (("none", tf.float32), ("bf16", tf.bfloat16)):
    seen.clear()
    trainer = make_trainer(small_config(
        num_devices=2, allreduce_compression=compression,
        allreduce_bucket_mb=0.004))
    for n in (5, 3, 2):
      metrics = trainer.train(n)
    assert trainer.trace_count == 1
    assert int(trainer.step.numpy()) == 10
    # One call per traced replica step (2 replicas trace it), holding the
    # kernel and bias of both Dense layers.
    assert [len(call) for call in seen] == [4, 4], compression
    assert all(d == wire for call in seen for d in call), compression
    trained[compression] = variables(trainer)
    trainer.close()
  # bf16 rounds what is summed: a small difference, but a difference.
  assert 0 < max_diff(trained["none"], trained["bf16"]) < 1e-2
  assert set(metrics) == {"train/loss", "train/accuracy", "train/grad_norm",
                          "train/skipped_steps", "train/skipped_steps_at_end"}
  assert metrics["train/loss"] > 0 and metrics["train/grad_norm"] > 0
  assert 0 <= metrics["train/accuracy"] <= 1


def test_a_non_finite_step_stops_the_loop_and_is_not_applied(small_config):
  trainer = make_trainer(small_config(dataset=NAN_DATASET, num_devices=2,
                                      optimizer="adam"))
  before = replica_copies(trainer)
  with pytest.raises(NonFiniteError, match="at step 1"):
    trainer.train(5)
  assert int(trainer.step.numpy()) == 1  # Stopped at the bad step.
  # Its NaN gradients reached no replica's variables, slots or counter.
  for b, a in zip(before, replica_copies(trainer)):
    for rb, ra in zip(b, a):
      np.testing.assert_array_equal(rb, ra)
  assert int(trainer.optimizer.iterations.numpy()) == 0
  assert all(not np.any(s) for s in trainer.optimizer.variables
             if "momentum" in s.path or "velocity" in s.path)
  trainer.close()


@pytest.fixture(name="resumed", scope="module")
def _resumed(tmp_path_factory):
  """A run to step 6, resumed to 12 with the flags text the entry point
  gives: (config, summary.json, flags.txt) as the resumed run left them."""
  from dist_loop import make_config  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path_factory.mktemp("resume") / "run")
  config = make_config(
      workdir=workdir, dataset="synthetic", model="mlp", num_devices=2,
      global_batch_size=32, train_steps=6, optimizer="adam",
      learning_rate=0.01, steps_per_loop=3, log_every=3, eval_every=100,
      checkpoint_every=100, seed=0)
  train.run(config)  # Saves a checkpoint at its last step, 6.
  config = config.replace(train_steps=12)
  train.run(config, flags_text="--train_steps=12\n")
  files = []
  for name in ("summary.json", "flags.txt"):
    with open(os.path.join(workdir, name)) as f:
      files.append(f.read())
  return config, json.loads(files[0]), files[1]


def test_resume_equals_uninterrupted(resumed):
  config, summary, _ = resumed
  assert summary["final_step"] == 12
  whole = make_trainer(config)
  whole.train(12)
  assert max_diff(variables(whole), checkpoint_variables(config)) <= 1e-6
  whole.close()
  # Rerunning a finished run trains nothing.
  before = checkpoint_variables(config)
  assert train.run(config)["final_step"] == 12
  assert max_diff(before, checkpoint_variables(config)) == 0


def test_the_run_leaves_summary_json_and_flags(resumed):
  config, summary, flags = resumed
  for key in ("final_step", "train_loss", "eval_loss", "eval_accuracy",
              "examples_per_sec", "wall_time_s"):
    assert summary[key] is not None, key
  # Float32 sync hands its all-reduce 4 bytes per weight per step.
  params = sum(v.size for v in checkpoint_variables(config))
  assert summary["allreduce_bytes_per_step"] == 4 * params
  assert summary["allreduce_bytes_total"] == 12 * 4 * params
  assert flags == "--train_steps=12\n"
