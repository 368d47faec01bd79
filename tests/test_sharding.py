"""Sharded sync (`--shard`, ZeRO stages 1-3): the same training, less state.

Every stage must equal unsharded sync (to 1e-6) whatever the optimizer,
precision and replica count (a covering set of them, `MATRIX`), and must
come back to the same variables after a rollback to its own checkpoint;
its checkpoints must be those of an unsharded run (restore in another mode,
at another replica count, then sharded again: one chain of runs that starts
from the matrix's stage-3 checkpoint); a step it does not apply must leave
its shards and model alone; and each device must hold its 1/N of an
unsharded device's state, read from the variables placed on it.
Trainers are driven directly where the controller adds nothing, and each
run of the matrix is built once and read by every test that needs it (the
equivalence, the rollback, the skipped steps, AdamW, the chain's first
link and reference), so the matrix stays cheap. What a replica holds and
sends is counted from the variables a trainer builds, so those figures
come from trainers that are built and never traced.
"""

import collections
import gc
import json
import os
import shutil
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import checkpoint_variables, max_diff
from dist_loop import configure, models, train
from dist_loop.core.errors import NonFiniteError, UserError
from dist_loop.parallel.sharding import layout
from dist_loop.runtime import checkpoints
from dist_loop.runtime.cluster import Cluster
from dist_loop.training import optim
from experiments.extensions import single_device  # pylint: disable=unused-import
from helpers import make_trainer, variables

STAGES = ("optimizer", "gradients", "weights")
# A covering set: every stage trains ADAM_3 (Adam, float32, 3 replicas:
# every variable of the MLP is padded, the 10-wide ones to 12), whose runs
# also give the checkpoint chain, and SGD_BF16 (2 replicas, bfloat16, with
# accumulation and bf16 on the wire); AdamW meets stage 3 in float16 with
# loss scaling, accumulation and the bf16 wire. So every stage meets Adam
# and SGD, both replica counts, mixed precision, accumulation, the bf16
# wire and a rollback, and stage 3 also a third optimizer, the loss scale
# and a skipped step (a float16 overflow, injected).
ADAM_3 = ("adam", "float32", 3, (("global_batch_size", 24),))
_MIXED = (("grad_accum_steps", 2), ("allreduce_compression", "bf16"))
ROWS = {
    "adam_3": ADAM_3,
    "sgd_bf16_2": ("sgd", "mixed_bfloat16", 2, _MIXED),
    "adamw_fp16_2": ("adamw", "mixed_float16", 2, _MIXED),
}
MATRIX = [
    ("optimizer", "adam_3"), ("gradients", "adam_3"), ("weights", "adam_3"),
    ("optimizer", "sgd_bf16_2"), ("gradients", "sgd_bf16_2"),
    ("weights", "sgd_bf16_2"), ("weights", "adamw_fp16_2"),
]
HALF = 3  # Steps per call; the checkpoint is taken after the first call.
SKIPPED = 4  # Overflowed steps after the run, under a loss scale.
_runs = {}  # Finished runs, shared by the tests that only read them.


def _flat(row, **overrides):
  opt, precision, replicas, extra = ROWS[row]
  return {**dict(num_devices=replicas, optimizer=opt, precision=precision,
                learning_rate=0.05), **dict(extra), **overrides}


def _shard_copies(trainer):
  """Every replica's copy of every shard variable, as numpy."""
  return [[np.asarray(t) for t in
           trainer.strategy.experimental_local_results(v.value)]
          for v in trainer.reduction.sharding.state.shards]


def _overflow(trainer):
  """SKIPPED steps whose float16 gradients overflow (the loss scale set to
  2**40 on every replica): {metrics, the variables and every replica's
  shards before and after, the optimizer's iterations before and after}."""
  before = variables(trainer), _shard_copies(trainer)
  iterations = int(trainer.optimizer.iterations.numpy())
  for copy in trainer.strategy.experimental_local_results(
      trainer.loss_scale.scale):
    copy.assign(2.0 ** 40)
  metrics = trainer.train(SKIPPED)
  return dict(metrics=metrics, before=before,
              after=(variables(trainer), _shard_copies(trainer)),
              iterations=(iterations,
                          int(trainer.optimizer.iterations.numpy())))


def _trained(config):
  """One trainer of `config`: {variables after 2 x HALF steps in two calls,
  the optimizer's class and weight decay; sharded: variables after rolling
  back to the checkpoint of step HALF and training HALF steps again, and,
  under a loss scale, `_overflow` after it}. The checkpoint stays in
  WORKDIR/checkpoints as a run would leave it."""
  trainer = make_trainer(config)
  trainer.train(HALF)
  path = checkpoints.manager(trainer.checkpoint_items(), config.workdir,
                             1).save(checkpoint_number=HALF)
  trainer.train(HALF)
  out = dict(variables=variables(trainer), workdir=config.workdir)
  if trainer.reduction.stage != "none":  # An unsharded run: a reference.
    # What a rollback does: restore mid-run, then train on.
    tf.train.Checkpoint(**trainer.checkpoint_items()).read(
        path).assert_existing_objects_matched()
    trainer.on_restore()
    trainer.train(HALF)
    out["rolled_back"] = variables(trainer)
  optimizer = (trainer.optimizer if trainer.reduction.stage == "none"
               else trainer.reduction.sharding.state.optimizer)
  out["optimizer"] = (type(optimizer).__name__,
                      float(getattr(optimizer, "weight_decay", 0) or 0))
  if trainer.reduction.stage != "none" and trainer.loss_scale is not None:
    out["overflow"] = _overflow(trainer)
  trainer.close()
  return out


@pytest.fixture(name="runs_dir", scope="module")
def _runs_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("sharded_runs")


@pytest.fixture(name="shared")
def _shared(small_config, runs_dir):
  """`_trained` of a flat config, once per module."""

  def run(**flat):
    key = json.dumps(flat, sort_keys=True)
    if key not in _runs:
      workdir = str(runs_dir / str(len(_runs)))
      _runs[key] = _trained(small_config(workdir=workdir, **flat))
    return _runs[key]

  return run


@pytest.mark.parametrize("stage,row", MATRIX)
def test_each_stage_equals_unsharded_and_rolls_back(shared, stage, row):
  reference = shared(**_flat(row))["variables"]
  run = shared(**_flat(row, shard=stage))
  assert max_diff(reference, run["variables"]) <= 1e-6
  # The replayed steps repeat the first ones; on the stage-3 bf16 row bit
  # for bit (a sharded run is deterministic).
  exact = (stage, row) == ("weights", "sgd_bf16_2")
  assert max_diff(run["variables"], run["rolled_back"]) <= (
      0 if exact else 1e-6)


def test_skipped_steps_leave_shards_and_model_alone(shared):
  """Stage 3 under a loss scale: overflowed steps are skipped on every
  replica, and neither a shard nor the host model moves."""
  run = shared(**_flat("adamw_fp16_2", shard="weights"))["overflow"]
  assert run["metrics"]["train/skipped_steps"] == SKIPPED
  assert "train/loss" not in run["metrics"]  # Never a loss of 0.
  assert run["metrics"]["train/loss_scale"] == 2.0 ** (40 - SKIPPED)
  model, shards = run["before"]
  assert max_diff(model, run["after"][0]) == 0
  for b, a in zip(shards, run["after"][1]):
    assert len(b) == 2  # Each replica's own shard ...
    for rb, ra in zip(b, a):  # ... left as it was.
      np.testing.assert_array_equal(rb, ra)
  assert run["iterations"][0] == run["iterations"][1] > 0


def test_adamw_decays_and_shards_alike(shared):
  """The matrix's AdamW row equals unsharded (above); here: both runs use
  the registry's AdamW, whose update (`optim.apply_reduced`, as every
  stage applies it) decays the weights where Adam's does not."""
  for flat in (_flat("adamw_fp16_2"), _flat("adamw_fp16_2", shard="weights")):
    name, decay = shared(**flat)["optimizer"]
    assert name == "AdamW" and decay > 0, (name, decay)
  moved = {}
  for name in ("adam", "adamw"):
    weight = keras.Variable(np.ones(4, np.float32))
    optim.apply_reduced(optim.make(name, 0.05, [weight]),
                        [tf.zeros(4)], [weight], tf.constant(True))
    moved[name] = 1.0 - np.asarray(weight)
  # A zero gradient: Adam's step is 0; the decay is 0.004 x 0.05 per step.
  np.testing.assert_array_equal(moved["adam"], 0.0)
  np.testing.assert_allclose(moved["adamw"], 0.004 * 0.05, rtol=1e-3)


def test_layout_pads_and_assembles():
  shapes = [tf.TensorShape([3, 5]), tf.TensorShape([7]), tf.TensorShape([2])]
  lay = layout.Layout(shapes, 4)
  assert lay.shard_sizes == [4, 2, 1] and lay.offsets == [0, 4, 6]
  assert lay.padding == 16 - 15 + 8 - 7 + 4 - 2
  values = [tf.reshape(tf.range(15.0), [3, 5]), tf.range(7.0) + 100,
            tf.constant([7.0, 8.0])]
  flats = [tf.concat([lay.shard(i, v, r) for i, v in enumerate(values)], 0)
           for r in range(4)]
  for i, v in enumerate(values):
    np.testing.assert_array_equal(lay.assemble(tf.concat(flats, 0), [0, 1, 2])
                                  [i], v)
  # A bucket of the second and third variables only.
  part = tf.concat([f[4:] for f in flats], 0)
  out = lay.assemble(part, [1, 2])
  np.testing.assert_array_equal(out[0], values[1])
  np.testing.assert_array_equal(out[1], values[2])


# -- checkpoints --


def _run(small_config, workdir, steps, **flat):
  """`train.run` of ADAM_3's settings to `steps` in `workdir`:
  (variables, summary)."""
  config = small_config(workdir=workdir, train_steps=steps,
                        checkpoint_every=HALF, eval_every=HALF,
                        steps_per_loop=HALF, log_every=HALF,
                        allow_config_change=True,
                        **_flat("adam_3", **flat))
  summary = train.run(config)
  return checkpoint_variables(config), summary


def _checkpoint_values(workdir):
  path = os.path.join(workdir, "checkpoints", f"ckpt-{HALF}")
  return {key: tf.train.load_variable(path, key)
          for key, _ in tf.train.list_variables(path)
          if key.startswith(("optimizer/", "model/"))}


def test_checkpoints_move_between_stages_replica_counts_and_modes(
    shared, small_config, tmp_path):
  """One chain, each run resuming the last one's checkpoint: stage 3 on 3
  replicas (the matrix's run, at step HALF) -> another mode on 1 -> stage 2
  on 2, against the matrix's unsharded run on 3."""
  unsharded = shared(**_flat("adam_3"))
  at_end = unsharded["variables"]
  weights = shared(**_flat("adam_3", shard="weights"))["workdir"]
  # The sharded checkpoint is an unsharded one: the same names, shapes
  # (stage 3 pads every variable on 3 replicas, the 10-wide ones to 12)
  # and values, slot for slot.
  expected = _checkpoint_values(unsharded["workdir"])
  got = _checkpoint_values(weights)
  assert sorted(expected) == sorted(got)
  assert any("_variables/5" in k for k in expected)  # Slots are there.
  for key, value in expected.items():
    np.testing.assert_allclose(got[key], value, atol=1e-6, err_msg=key)
  chain = str(tmp_path / "chain")
  shutil.copytree(os.path.join(weights, "checkpoints"),
                  os.path.join(chain, "checkpoints"))
  # Another mode on 1, then sharded on 2. Another replica count sums the
  # shares in another order: the tolerance of N devices = 1 device.
  _run(small_config, chain, HALF + 1, num_devices=1, mode="single_device")
  moved, summary = _run(small_config, chain, 2 * HALF, num_devices=2,
                        shard="gradients")
  assert max_diff(at_end, moved) <= 1e-5
  with open(os.path.join(chain, "summary.json")) as f:
    assert json.load(f)["memory_held_mb"] == summary["memory_held_mb"]
  assert summary["shard"] == "gradients"
  assert summary["memory_gradients_mb"] < summary["memory_weights_mb"]


# -- crossings --


def test_max_loss_stops_a_sharded_step(small_config):
  trainer = make_trainer(small_config(num_devices=2, shard="optimizer",
                                      max_loss=1e-3))
  with pytest.raises(NonFiniteError) as error:
    trainer.train(3)
  assert error.value.step == 1
  trainer.close()


@pytest.mark.parametrize("flat,match", [
    (dict(allreduce_compression="powersgd"), "cannot be combined with "
     "--allreduce_compression=powersgd"),
    (dict(allreduce_compression="topk"), "--allreduce_compression=topk"),
    (dict(optimizer="sharded_test_nonelementwise"), "element-wise"),
])
def test_refusals_name_the_fix(small_config, flat, match):
  if "sharded_test_nonelementwise" not in optim.OPTIMIZERS.names():
    optim.OPTIMIZERS.register("sharded_test_nonelementwise")(
        lambda lr: keras.optimizers.Lion(lr))
  with pytest.raises(UserError, match=match):
    configure.validate(small_config(num_devices=2, shard="gradients",
                                    **flat), Cluster())


def test_stage_three_refuses_non_trainable_state(small_config):
  if "sharded_test_bn" not in models.MODELS.names():
    models.MODELS.register("sharded_test_bn")(
        lambda input_shape, num_classes: [
            keras.layers.Flatten(), keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(num_classes)])
  config = small_config(num_devices=2, shard="weights",
                        model="sharded_test_bn")
  with pytest.raises(UserError, match="non-trainable state.*--reducer=zero2"):
    make_trainer(config)


# -- what a replica holds and sends --


def _held_by_device(config):
  """`config`'s trainer, just built, and the bytes of the variables alive
  on each device {device index: bytes}: every variable TensorFlow created
  while the trainer was built, where it placed it (a mirrored variable is
  one variable per device), whichever object holds it."""
  created = []

  def record(next_creator, **kwargs):
    variable = next_creator(**kwargs)
    created.append(weakref.ref(variable))
    return variable

  with tf.variable_creator_scope(record):
    trainer = make_trainer(config)
  gc.collect()  # What was built and dropped is not held.
  held = collections.Counter()
  for ref in created:
    variable = ref()
    if variable is not None:
      index = tf.DeviceSpec.from_string(variable.device).device_index
      held[index] += variable.shape.num_elements() * variable.dtype.size
  return trainer, held


def test_devices_hold_a_share_of_an_unsharded_device_and_send_1_5x(
    small_config):
  """Adam in float32 on 4 replicas, each stage's trainer built and never
  traced: what each device holds is read from the variables TensorFlow
  placed on it, against the unsharded trainer's."""
  n, held, seen = 4, {}, {}
  for stage in ("none",) + STAGES:
    trainer, held[stage] = _held_by_device(small_config(
        num_devices=n, optimizer="adam", shard=stage))
    weights = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                  for v in trainer.model.trainable_variables)
    seen[stage] = trainer.report().scalars
    trainer.close()
  # Unsharded: every device a full copy (the weights and Adam's slots).
  full = held["none"][0]
  assert held["none"] == {d: full for d in range(n)} and full > 3 * weights
  for stage in STAGES:
    got = held[stage]
    assert sorted(got) == list(range(n))
    share = got[1]  # Device 0 is also the host here (below).
    assert [got[d] for d in range(2, n)] == [share] * (n - 2)
    # Together the devices hold one unsharded device's state, each 1/n of
    # it (up to the padding of each variable to a multiple of n, and the
    # few scalars every device keeps); stages 1 and 2 also keep the full
    # weights on every device. (Stage 2's saving is the reduced gradient,
    # a tensor of the step, not a variable.)
    kept = 0 if stage == "weights" else weights
    assert n * (share - kept) == pytest.approx(full, rel=1e-2), stage
    # Stage 3's model is a host copy for evaluation and checkpoints, on the
    # host's CPU: here device 0.
    host = weights if stage == "weights" else 0
    assert got[0] - share == host, stage
  # The memory/... scalars count what the devices hold: the variables
  # but the scalars (step, the optimizer's iterations and learning rate).
  for stage in ("none",) + STAGES:
    reported = (seen[stage]["memory/weights_mb"]
                + seen[stage]["memory/optimizer_mb"]) * 2**20
    assert 0 <= held[stage][1] - reported <= 64, stage
  assert seen["weights"]["memory/host_weights_mb"] * 2**20 == weights
  # Ring bytes: an all-reduce standing in for a reduce-scatter, and one
  # gather of the weights: 1.5x plain data parallelism (stage 3 adds the
  # host copy's gather once per loop of 5 steps).
  ring = seen["none"]["comm/ring_bytes_per_step"]
  assert seen["optimizer"]["comm/ring_bytes_per_step"] == pytest.approx(
      1.5 * ring, rel=1e-2)
  assert seen["weights"]["comm/ring_bytes_per_step"] == pytest.approx(
      (1.5 + 0.5 / 5) * ring, rel=1e-2)
