"""Buckets and sharding across processes equal one process.

Two workers (MultiWorkerMirroredStrategy over localhost gRPC) train with
small buckets, gradient accumulation, bfloat16 on the wire and in compute,
stop half way and resume, unsharded and with ZeRO-3; one process with two
devices trains the same steps uninterrupted, unsharded, in one bucket. The
math must not change. Each case is one launch pair crossing everything at
once: multi-process tests are the suite's slowest.
"""

import sys

import pytest

from conftest import checkpoint_variables, max_diff, run_launch, \
    trained_variables
from dist_loop import make_config

RUN = dict(dataset="synthetic", model="mlp", global_batch_size=32,
           optimizer="adam", learning_rate=0.01, steps_per_loop=3,
           log_every=3, eval_every=100000, checkpoint_every=3, seed=0,
           grad_accum_steps=2, allreduce_compression="bf16",
           precision="mixed_bfloat16")
BUCKET_MB = 0.001  # Every layer's gradients in a bucket of their own.


def _flags(**overrides):
  return [f"--{k}={v}" for k, v in {**RUN, **overrides}.items()]


@pytest.mark.parametrize("shard", ["none", "weights"])
def test_two_workers_in_buckets_with_resume_equal_one_process(tmp_path,
                                                              shard):
  workdir = tmp_path / "workers"
  for steps in (3, 6):  # The second launch resumes from step 3.
    result = run_launch(
        "--num_workers=2", "--", sys.executable, "-m", "experiments.train",
        *_flags(train_steps=steps, num_devices=1, shard=shard,
                allreduce_bucket_mb=BUCKET_MB), f"--workdir={workdir}")
    assert result.returncode == 0, result.stdout[-3000:]
  # Resumed at step 3: the second launch logged step 6 only.
  assert "step 6/6" in result.stdout and "step 3/6" not in result.stdout, (
      result.stdout[-3000:])
  workers = checkpoint_variables(make_config(
      workdir=str(workdir), **RUN, train_steps=6, num_devices=1))
  one = trained_variables(make_config(
      workdir=str(tmp_path / "one"), **RUN, train_steps=6, num_devices=2,
      allreduce_bucket_mb=0))
  assert max_diff(workers, one) <= 1e-6
