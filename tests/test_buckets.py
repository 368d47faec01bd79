"""Bucketed all-reduce in sync mode (`--allreduce_bucket_mb`).

The buckets must (1) travel as several collectives, last layers first, each
depending only on its own gradients, so that communication can overlap the
rest of the backward pass, and (2) change nothing in the math: bucketed
equals one bucket, crossed with accumulation, bf16 on the wire, mixed
precision and resume, in one test (the float32 wire cuts its buckets as
the bf16 one does: both are `compression/cast.py`'s `Cast`). The
multi-process crossing is in test_multiworker.py.
"""

import os

import pytest
import tensorflow as tf

from conftest import max_diff, read_events, trained_variables
from dist_loop import configure, data
from dist_loop.core.errors import UserError
from dist_loop.parallel.modes import build_trainer
from dist_loop.runtime import checkpoints, devices
from dist_loop.runtime.cluster import Cluster
from helpers import make_trainer, variables

TINY_BUCKET_MB = 0.001  # About 1 KB: every gradient of the test MLP its own.


def _trainer(small_config, **overrides):
  config = configure.validate(small_config(**overrides), Cluster())
  names = devices.configure(config.num_devices, "cpu")
  return build_trainer(config, names, data.load(config), Cluster())


def _collectives(trainer):
  """The all-reduces of one traced step, in the order they were created,
  each with the names of every op it depends on."""
  x, y = (tf.constant(trainer.dataset.train_x[:32]),
          tf.constant(trainer.dataset.train_y[:32]))

  @tf.function(autograph=False)
  def step(x, y):
    return trainer.strategy.run(
        lambda x, y: trainer.replica_step((x, y), None).shares, args=(x, y))

  graph = step.get_concrete_function(x, y).graph
  out = []
  for op in graph.get_operations():
    if (op.type != "CollectiveReduceV2"
        or tf.DeviceSpec.from_string(op.device).device_index != 0):
      continue  # Replica 0's only.
    seen, stack = set(), [op]
    while stack:
      node = stack.pop()
      for parent in [t.op for t in node.inputs] + list(node.control_inputs):
        if parent.name not in seen:
          seen.add(parent.name)
          stack.append(parent)
    out.append((op, seen))
  return out


def _gradient_of(layer, names):
  """Whether any op among `names` is the backward pass of `layer`."""
  return any(n.startswith("gradient_tape") and f"/{layer}" in n
             for n in names)


@pytest.fixture(name="runs", scope="module")
def _runs():
  """{bucket MB: collectives of a traced step} of float32 sync on 2
  replicas, in tiny buckets and in one. Nothing is trained: that bucketed
  equals one bucket is `test_bucketed_and_resumed_equals_one_bucket...`."""
  from dist_loop import make_config  # pylint: disable=g-import-not-at-top
  out = {}
  for bucket_mb in (TINY_BUCKET_MB, 0.0):
    config = configure.validate(make_config(
        workdir="/tmp/unused", dataset="synthetic", model="mlp",
        num_devices=2, global_batch_size=32, optimizer="sgd",
        learning_rate=0.1, seed=0, allreduce_bucket_mb=bucket_mb), Cluster())
    trainer = build_trainer(config, devices.configure(2, "cpu"),
                            data.load(config), Cluster())
    out[bucket_mb] = _collectives(trainer)
    trainer.close()
  return out


def test_buckets_travel_last_layers_first_each_on_its_own_gradients(runs):
  collectives = runs[TINY_BUCKET_MB]
  # Four gradients (two kernels, two biases), a bucket closing once it
  # passes 1 KB: the logits layer's, then the first layer's. The first to
  # go needs nothing of the first layer's backward pass.
  assert len(collectives) == 2
  first, last = collectives[0][1], collectives[-1][1]
  assert _gradient_of("logits", first)
  assert not _gradient_of("dense_1", first)
  assert _gradient_of("dense_1", last)


def test_one_bucket_waits_for_the_whole_backward_pass(runs):
  collectives = runs[0.0]
  assert len(collectives) == 1
  assert _gradient_of("dense_1", collectives[0][1])
  assert _gradient_of("logits", collectives[0][1])


def test_bucketed_and_resumed_equals_one_bucket_with_accumulation_and_bf16(
    small_config):
  """One bucket for 10 steps uninterrupted, its checkpoint of step 5 kept;
  a bucketed run resumes from that checkpoint for steps 6 to 10."""
  crossing = dict(num_devices=2, grad_accum_steps=2,
                  allreduce_compression="bf16", precision="mixed_bfloat16",
                  optimizer="adam", learning_rate=0.01)
  one = small_config(allreduce_bucket_mb=0, **crossing)
  trainer = make_trainer(one)
  trainer.train(5)
  checkpoints.manager(trainer.checkpoint_items(), one.workdir, 1).save(
      checkpoint_number=5)
  trainer.train(5)
  uninterrupted = variables(trainer)
  trainer.close()
  resumed = trained_variables(small_config(
      allreduce_bucket_mb=TINY_BUCKET_MB, **crossing))
  assert max_diff(uninterrupted, resumed) <= 1e-6
  # It resumed: its only log line (every 5 steps) is step 10's.
  assert set(read_events(os.path.join(one.workdir, "tb"))["train/loss"]) == {
      10}


@pytest.mark.parametrize("compression", ["powersgd", "topk"])
def test_a_compressor_that_cannot_take_buckets_says_so(small_config,
                                                       compression):
  with pytest.raises(UserError, match="--allreduce_bucket_mb is an option "
                     "of --reducer=cast or --reducer=exact"):
    configure.validate(small_config(
        num_devices=2, allreduce_compression=compression,
        allreduce_bucket_mb=1.0), Cluster())
  # At the default it runs, with its own collectives.
  trainer = _trainer(small_config, num_devices=2,
                     allreduce_compression=compression)
  assert trainer.reduction.compressor.communication.bytes_per_pack == 0
  trainer.close()


def test_the_default_bucket_reaches_the_collectives(small_config):
  trainer = _trainer(small_config, num_devices=2)
  default_mb = trainer.config.reducer_options.allreduce_bucket_mb
  assert default_mb > 0
  assert (trainer.reduction.compressor.communication.bytes_per_pack
          == int(default_mb * 2**20))
  trainer.close()
