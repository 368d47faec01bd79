"""Sharded sync (`--shard`, ZeRO stages 1-3): the same training, less state.

Every stage must equal unsharded sync (to 1e-6) whatever the optimizer,
precision and replica count (a covering set of them, `MATRIX`); its
checkpoints must be those of an unsharded run (restore either way, at
another replica count, in another mode: one chain of runs); and it must
hold what ZeRO's formulas say. Trainers are driven directly where the
controller adds nothing, and runs are shared between the tests that only
read them, so the matrix stays cheap.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import checkpoint_variables, max_diff
from dist_loop import checkpoints, configure, models, optim, train
from dist_loop.cluster import Cluster
from dist_loop.errors import NonFiniteError, UserError
from dist_loop.sharding import accounting, layout
from experiments.extensions import single_device  # pylint: disable=unused-import
from helpers import NAN_DATASET, make_trainer, variables

STAGES = ("optimizer", "gradients", "weights")
# A covering set: every stage trains ADAM_4 (Adam, float32, 4 replicas),
# whose runs also give the memory figures, and one 2-replica SGD row in
# mixed precision with accumulation and bf16 on the wire: bfloat16 for
# stages 1 and 3, float16 (loss scaling) for stage 2. So every stage meets
# both optimizers, both replica counts, mixed precision, accumulation and
# the bf16 wire; AdamW (below) is a third optimizer on stage 3.
ADAM_4 = ("adam", "float32", 4, ())
_MIXED = (("grad_accum_steps", 2), ("allreduce_compression", "bf16"))
ROWS = {
    "adam_4": ADAM_4,
    "sgd_bf16_2": ("sgd", "mixed_bfloat16", 2, _MIXED),
    "sgd_fp16_2": ("sgd", "mixed_float16", 2, _MIXED),
}
MATRIX = [
    ("optimizer", "adam_4"), ("gradients", "adam_4"), ("weights", "adam_4"),
    ("optimizer", "sgd_bf16_2"), ("weights", "sgd_bf16_2"),
    ("gradients", "sgd_fp16_2"),
]
_runs = {}  # Finished runs, shared by the tests that only read them.


def _flat(row, **overrides):
  opt, precision, replicas, extra = ROWS[row]
  return {**dict(num_devices=replicas, optimizer=opt, precision=precision,
                learning_rate=0.05), **dict(extra), **overrides}


def _trained(config, steps=8):
  """(variables, report scalars) after `steps` steps in two calls."""
  trainer = make_trainer(config)
  trainer.train(steps // 2)
  trainer.train(steps - steps // 2)
  out = variables(trainer), trainer.report().scalars
  trainer.close()
  return out


def _shared(small_config, **flat):
  """`_trained` of `flat`, once per module."""
  key = json.dumps(flat, sort_keys=True)
  if key not in _runs:
    _runs[key] = _trained(small_config(**flat))
  return _runs[key]


@pytest.mark.parametrize("stage,row", MATRIX)
def test_each_stage_equals_unsharded(small_config, stage, row):
  reference, _ = _shared(small_config, **_flat(row))
  sharded, _ = _shared(small_config, **_flat(row, shard=stage))
  assert max_diff(reference, sharded) <= 1e-6


def test_adamw_decays_and_shards_alike(small_config):
  adam, _ = _shared(small_config, **_flat("adam_4"))
  flat = _flat("adam_4", optimizer="adamw", num_devices=2)
  unsharded, _ = _trained(small_config(**flat))
  sharded, _ = _trained(small_config(**flat, shard="weights"))
  assert max_diff(unsharded, sharded) <= 1e-6
  # The decay is applied: Keras' 0.004 x the learning rate of the weights,
  # per step, is ~5e-4 after 8 steps, far above what Adam on 4 replicas
  # and on 2 differ by (<= 1e-5, N devices = 1 device).
  assert max_diff(adam, unsharded) > 1e-4


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
  """`train.run` to `steps` in `workdir`: (variables, summary)."""
  config = small_config(workdir=workdir, train_steps=steps,
                        checkpoint_every=3, eval_every=3, steps_per_loop=3,
                        log_every=3, allow_config_change=True,
                        optimizer="adam", **flat)
  summary = train.run(config)
  return checkpoint_variables(config), summary


def test_checkpoints_move_between_stages_replica_counts_and_modes(
    small_config, tmp_path):
  """One chain, each run resuming the last one's checkpoint: stage 3 on 4
  replicas -> stage 1 on 4 -> another mode on 1 -> stage 2 on 2."""
  # The uninterrupted reference: unsharded Adam on 4 replicas, with its
  # checkpoint at step 3 and its variables at steps 6 and 12.
  unsharded = str(tmp_path / "none")
  trainer = make_trainer(small_config(optimizer="adam", num_devices=4))
  trainer.train(3)
  checkpoints.manager(trainer.checkpoint_items(), unsharded, 1).save(
      checkpoint_number=3)
  trainer.train(3)
  at_6 = variables(trainer)
  trainer.train(6)
  at_12 = variables(trainer)
  trainer.close()

  chain = str(tmp_path / "chain")
  _run(small_config, chain, 3, num_devices=4, shard="weights")
  # The sharded checkpoint is an unsharded one: the same names, shapes
  # (stage 3 pads the 10-wide variables to 12 on 4 replicas) and values,
  # slot for slot.
  keys = {}
  for name, workdir in (("none", unsharded), ("weights", chain)):
    path = os.path.join(workdir, "checkpoints", "ckpt-3")
    keys[name] = {key: tf.train.load_variable(path, key)
                  for key, _ in tf.train.list_variables(path)
                  if key.startswith(("optimizer/", "model/"))}
  assert sorted(keys["none"]) == sorted(keys["weights"])
  assert any("_variables/5" in k for k in keys["none"])  # Slots are there.
  for key, value in keys["none"].items():
    np.testing.assert_allclose(keys["weights"][key], value, atol=1e-6,
                               err_msg=key)
  # Resumed in another stage equals uninterrupted.
  resumed, _ = _run(small_config, chain, 6, num_devices=4, shard="optimizer")
  assert max_diff(at_6, resumed) <= 1e-6
  # Another mode on 1, then sharded on 2. Another replica count sums the
  # shares in another order: the tolerance of N devices = 1 device.
  _run(small_config, chain, 9, num_devices=1, mode="single_device")
  moved, summary = _run(small_config, chain, 12, num_devices=2,
                        shard="gradients")
  assert max_diff(at_12, moved) <= 1e-5
  with open(os.path.join(chain, "summary.json")) as f:
    assert json.load(f)["memory_held_mb"] == summary["memory_held_mb"]
  assert summary["shard"] == "gradients"
  assert summary["memory_gradients_mb"] < summary["memory_weights_mb"]


def test_restore_reloads_the_shards(small_config, tmp_path):
  """What a rollback does: restore mid-run, then train on."""
  config = small_config(num_devices=2, shard="gradients", optimizer="adam",
                        workdir=str(tmp_path / "r"))
  trainer = make_trainer(config)
  trainer.train(3)
  checkpoint = tf.train.Checkpoint(**trainer.checkpoint_items())
  path = checkpoint.write(str(tmp_path / "ckpt"))
  trainer.train(3)
  first = variables(trainer)
  checkpoint.read(path).assert_consumed()
  trainer.on_restore()
  trainer.train(3)
  assert max_diff(first, variables(trainer)) <= 1e-6
  trainer.close()


# -- crossings --


def test_skipped_steps_leave_shards_and_model_alone(small_config):
  config = small_config(num_devices=2, shard="weights", dataset=NAN_DATASET,
                        nonfinite="skip")
  trainer = make_trainer(config)
  before = variables(trainer)
  metrics = trainer.train(4)
  assert metrics["train/skipped_steps"] == 4
  assert "train/loss" not in metrics  # Never a loss of 0.
  assert max_diff(before, variables(trainer)) == 0
  trainer.close()


def test_max_loss_stops_a_sharded_step(small_config):
  trainer = make_trainer(small_config(num_devices=2, shard="optimizer",
                                      max_loss=1e-3))
  with pytest.raises(NonFiniteError) as error:
    trainer.train(3)
  assert error.value.step == 1
  trainer.close()


def test_deterministic_sharded_runs_repeat(small_config):
  flat = _flat("sgd_bf16_2", shard="weights")
  first, _ = _shared(small_config, **flat)
  again, _ = _trained(small_config(deterministic=True, **flat))
  assert max_diff(first, again) == 0


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
  with pytest.raises(UserError, match="non-trainable state.*--shard=gradients"):
    make_trainer(config)


# -- what a replica holds and sends --


def test_memory_and_bytes_follow_the_formulas(small_config):
  """Read from the matrix's runs of ADAM_4 (Adam, 4 replicas)."""
  seen = {stage: _shared(small_config, **_flat(
      "adam_4", **({} if stage == "none" else {"shard": stage})))[1]
          for stage in ("none",) + STAGES}
  psi = seen["none"]["memory/weights_mb"]
  # Unsharded Adam: 4 + 4 + 8 bytes per parameter, as ZeRO counts.
  assert seen["none"]["memory/held_mb"] == pytest.approx(4 * psi)
  assert seen["none"]["memory/optimizer_mb"] == pytest.approx(2 * psi)
  for stage in STAGES:
    got = seen[stage]
    # The slots are divided by 4, up to padding.
    assert got["memory/optimizer_mb"] == pytest.approx(
        2 * psi / 4 + 2 * got["memory/padding_mb"], rel=1e-3)
    # Held = the formula + what the run adds: the float32 shard of stages
    # 1 and 2, and the padding of each shard held (weights, slots, and the
    # gradient's from stage 2 on).
    extra = 0.0 if stage == "weights" else psi / 4
    padded = 3 if stage == "optimizer" else 4
    assert got["memory/held_mb"] == pytest.approx(
        got["memory/zero_formula_mb"] + extra
        + padded * got["memory/padding_mb"], rel=1e-6)
  held = [seen[s]["memory/held_mb"] for s in ("none",) + STAGES]
  assert held == sorted(held, reverse=True) and held[-1] < held[0] / 3
  # Ring bytes: an all-reduce standing in for a reduce-scatter, and one
  # gather of the weights: 1.5x plain data parallelism (stage 3 adds the
  # host copy's gather once per loop of 5 steps).
  ring = seen["none"]["comm/ring_bytes_per_step"]
  assert seen["optimizer"]["comm/ring_bytes_per_step"] == pytest.approx(
      1.5 * ring, rel=1e-2)
  assert seen["weights"]["comm/ring_bytes_per_step"] == pytest.approx(
      (1.5 + 0.5 / 5) * ring, rel=1e-2)
  assert accounting.zero_formula("weights", 100, 4, 8) == 400
