"""The synchronous step: one all-reduce in the wire dtype, no retracing,
metrics, non-finite detection, resume."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import checkpoint_variables, max_diff
from dist_loop import make_config, train
from dist_loop.core.errors import NonFiniteError
from helpers import NAN_DATASET, make_trainer, replica_copies, variables


# The run of every test here: 2 replicas, Adam (its slots must resume too).
RUN = dict(dataset="synthetic", model="mlp", num_devices=2,
           global_batch_size=32, optimizer="adam", learning_rate=0.01,
           steps_per_loop=3, log_every=3, eval_every=100,
           checkpoint_every=100, seed=0)
LOOPS = (5, 3, 4)  # Loops of any length, 12 steps.


def _spy_all_reduce(monkeypatch):
  """Records the dtypes of what reaches `ReplicaContext.all_reduce`."""
  seen = []
  original = tf.distribute.ReplicaContext.all_reduce

  def spy(self, reduce_op, value, options=None):
    seen.append([t.dtype for t in tf.nest.flatten(value)])
    return original(self, reduce_op, value, options=options)

  monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", spy)
  return seen


def _run_loops(workdir, compression):
  """A trainer of RUN over LOOPS, its all-reduces spied on while it traces:
  {seen, trace_count, step, metrics (of the last loop), variables}."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    seen = _spy_all_reduce(monkeypatch)
    trainer = make_trainer(make_config(
        workdir=workdir, train_steps=sum(LOOPS),
        allreduce_compression=compression, allreduce_bucket_mb=0.004, **RUN))
    for n in LOOPS:
      metrics = trainer.train(n)
  out = dict(seen=seen, trace_count=trainer.trace_count,
             step=int(trainer.step.numpy()), metrics=metrics,
             variables=variables(trainer))
  trainer.close()
  return out


@pytest.fixture(name="uninterrupted", scope="module")
def _uninterrupted(tmp_path_factory):
  """The float32 run: the all-reduce test's and the resume test's
  reference."""
  return _run_loops(str(tmp_path_factory.mktemp("whole")), "none")


def test_one_all_reduce_carries_every_gradient_in_the_wire_dtype(
    uninterrupted, tmp_path):
  """Loops of any length share one trace, and report the metrics."""
  runs = {"none": uninterrupted, "bf16": _run_loops(str(tmp_path), "bf16")}
  for (compression, run), wire in zip(runs.items(),
                                      (tf.float32, tf.bfloat16)):
    assert run["trace_count"] == 1
    assert run["step"] == sum(LOOPS)
    # One call per traced replica step (2 replicas trace it), holding the
    # kernel and bias of both Dense layers.
    assert [len(call) for call in run["seen"]] == [4, 4], compression
    assert all(d == wire for call in run["seen"] for d in call), compression
    metrics = run["metrics"]
    assert set(metrics) == {"train/loss", "train/accuracy",
                            "train/grad_norm", "train/skipped_steps",
                            "train/skipped_steps_at_end"}
    assert metrics["train/loss"] > 0 and metrics["train/grad_norm"] > 0
    assert 0 <= metrics["train/accuracy"] <= 1
  # bf16 rounds what is summed: a small difference, but a difference.
  assert 0 < max_diff(runs["none"]["variables"],
                      runs["bf16"]["variables"]) < 1e-2


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
  workdir = str(tmp_path_factory.mktemp("resume") / "run")
  config = make_config(workdir=workdir, train_steps=6, **RUN)
  train.run(config)  # Saves a checkpoint at its last step, 6.
  config = config.replace(train_steps=12)
  train.run(config, flags_text="--train_steps=12\n")
  files = []
  for name in ("summary.json", "flags.txt"):
    with open(os.path.join(workdir, name)) as f:
      files.append(f.read())
  return config, json.loads(files[0]), files[1]


def test_resume_equals_uninterrupted(resumed, uninterrupted):
  config, summary, _ = resumed
  assert summary["final_step"] == 12
  assert max_diff(uninterrupted["variables"],
                  checkpoint_variables(config)) <= 1e-6
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
  # A healthy run (resumed: measured from the first run's first loss) is
  # not diverged.
  assert summary["diverged"] is None
  assert summary["train_loss"] < summary["first_train_loss"]
