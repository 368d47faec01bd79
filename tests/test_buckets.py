"""Bucketed all-reduce in sync mode (`--allreduce_bucket_mb`).

The buckets must (1) travel as several collectives, last layers first, each
depending only on its own gradients, so that communication can overlap the
rest of the backward pass, (2) carry every gradient once, in packs of at
least the bucket size, measured from the collectives of a traced step, and
(3) change nothing in the math: bucketed equals one bucket, crossed with
accumulation, bf16 on the wire, mixed precision and resume, in one test
(the float32 wire cuts its buckets as the bf16 one does: both are
`compression/cast.py`'s `Cast`). The multi-process crossing is in
test_multiworker.py.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import max_diff, read_events, trained_variables
from dist_loop import configure, models
from dist_loop.core.errors import UserError
from dist_loop.parallel.modes import build_trainer
from dist_loop.runtime import checkpoints, devices
from dist_loop.runtime.cluster import Cluster
from helpers import (handed_bytes, load_data, make_trainer, step_graph,
                     variables)

TINY_BUCKET_MB = 0.001  # About 1 KB: every gradient of the test MLP its own.
MB = 2**20
# Six 1 MB kernels among small ones: the default bucket (4 MB) decides the
# packs.
models.MODELS.register("buckets_test_deep")(
    lambda input_shape, num_classes: (
        [keras.layers.Flatten(), keras.layers.Dense(512)]
        + [keras.layers.Dense(512) for _ in range(6)]
        + [keras.layers.Dense(num_classes)]))


def _trainer(small_config, **overrides):
  config = configure.validate(small_config(**overrides), Cluster())
  names = devices.configure(config.num_devices, "cpu")
  return build_trainer(config, names, load_data(config), Cluster())


def _collectives(graph):
  """The all-reduces of a traced step's `graph` (`helpers.step_graph`), in
  the order they were created, each with the names of every op it depends
  on."""
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


def _pack_bytes(collectives):
  """The bytes each all-reduce of `_collectives` carries."""
  return [op.inputs[0].shape.num_elements() * op.inputs[0].dtype.size
          for op, _ in collectives]


def _weight_bytes(trainer):
  """The bytes of the gradients: one per weight, of its dtype."""
  return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
             for v in trainer.model.trainable_variables)


def _gradient_of(layer, names):
  """Whether any op among `names` is the backward pass of `layer`."""
  return any(n.startswith("gradient_tape") and f"/{layer}" in n
             for n in names)


@pytest.fixture(name="runs", scope="module")
def _runs():
  """{bucket MB: collectives of a traced step} of float32 sync on 2
  replicas, in tiny buckets and in one, and "gradient": the gradient's
  bytes. Nothing is trained: that bucketed equals one bucket is
  `test_bucketed_and_resumed_equals_one_bucket...`."""
  from dist_loop import make_config  # pylint: disable=g-import-not-at-top
  out = {}
  for bucket_mb in (TINY_BUCKET_MB, 0.0):
    config = configure.validate(make_config(
        workdir="/tmp/unused", dataset="synthetic", model="mlp",
        num_devices=2, global_batch_size=32, optimizer="sgd",
        learning_rate=0.1, seed=0, allreduce_bucket_mb=bucket_mb), Cluster())
    trainer = build_trainer(config, devices.configure(2, "cpu"),
                            load_data(config), Cluster())
    out[bucket_mb] = _collectives(step_graph(trainer))
    out["gradient"] = _weight_bytes(trainer)
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


def test_packs_carry_every_gradient_once_each_at_least_a_bucket(runs):
  for bucket_mb in (TINY_BUCKET_MB, 0.0):
    packs = _pack_bytes(runs[bucket_mb])
    assert sum(packs) == runs["gradient"]
    assert min(packs[:-1], default=np.inf) >= bucket_mb * MB


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
  # Its options have no bucket: each of its calls (PowerSGD's: several
  # tensors) is one collective of all it hands over.
  config = small_config(num_devices=2, reducer=compression)
  assert not hasattr(config.reducer_options, "allreduce_bucket_mb")
  trainer = build_trainer(config, devices.configure(2, "cpu"),
                          load_data(config), Cluster())
  calls, graph = handed_bytes(trainer)
  assert _pack_bytes(_collectives(graph)) == [
      n for kind, n in calls if kind == "all_reduce"]
  trainer.close()


def test_the_default_bucket_cuts_a_gradient_larger_than_it(small_config):
  """6.3 MB of gradients, in 1 MB and smaller pieces: with the default
  bucket (4 MB) they travel in packs of at least 4 MB, the last possibly
  smaller, each gradient once."""
  trainer = _trainer(small_config, num_devices=2, model="buckets_test_deep")
  default_mb = trainer.config.reducer_options.allreduce_bucket_mb
  packs = _pack_bytes(_collectives(step_graph(trainer)))
  assert default_mb * MB < _weight_bytes(trainer)
  assert len(packs) >= 2 and sum(packs) == _weight_bytes(trainer)
  assert min(packs[:-1]) >= default_mb * MB
  trainer.close()
