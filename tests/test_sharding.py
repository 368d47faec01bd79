"""Sharded sync (`--shard`, ZeRO stages 1-3): the same training, less state.

Every stage must equal unsharded sync (to 1e-6) whatever the optimizer,
precision and replica count (a covering set of them, `MATRIX`), and must
come back to the same variables after a rollback to its own checkpoint;
its checkpoints must be those of an unsharded run (restore in another mode,
at another replica count, then sharded again: one chain of runs that starts
from the matrix's stage-3 checkpoint); and it must hold what ZeRO's
formulas say. Trainers are driven directly where the controller adds
nothing, and each run of the matrix is built once and read by every test
that needs it (the equivalence, the rollback, the chain's first link and
reference, the memory figures, the repeat), so the matrix stays cheap.
"""

import json
import os
import shutil

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
# whose runs also give the memory figures and the checkpoint chain, and one
# 2-replica SGD row in mixed precision with accumulation and bf16 on the
# wire: bfloat16 for stages 1 and 3, float16 (loss scaling) for stage 2. So
# every stage meets both optimizers, both replica counts, mixed precision,
# accumulation, the bf16 wire and a rollback; AdamW (below) is a third
# optimizer on stage 3.
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
HALF = 3  # Steps per call; the checkpoint is taken after the first call.
_runs = {}  # Finished runs, shared by the tests that only read them.


def _flat(row, **overrides):
  opt, precision, replicas, extra = ROWS[row]
  return {**dict(num_devices=replicas, optimizer=opt, precision=precision,
                learning_rate=0.05), **dict(extra), **overrides}


def _trained(config):
  """One trainer of `config`: (variables after 2 x HALF steps in two calls,
  report scalars, variables after rolling back to the checkpoint of step
  HALF and training HALF steps again). The checkpoint stays in
  WORKDIR/checkpoints as a run would leave it."""
  trainer = make_trainer(config)
  trainer.train(HALF)
  path = checkpoints.manager(trainer.checkpoint_items(), config.workdir,
                             1).save(checkpoint_number=HALF)
  trainer.train(HALF)
  out = variables(trainer), trainer.report().scalars
  # What a rollback does: restore mid-run, then train on.
  tf.train.Checkpoint(**trainer.checkpoint_items()).read(
      path).assert_existing_objects_matched()
  trainer.on_restore()
  trainer.train(HALF)
  rolled_back = variables(trainer)
  trainer.close()
  return out + (rolled_back,)


@pytest.fixture(name="runs_dir", scope="module")
def _runs_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("sharded_runs")


@pytest.fixture(name="shared")
def _shared(small_config, runs_dir):
  """`_trained` of a flat config, once per module, plus its workdir."""

  def run(**flat):
    key = json.dumps(flat, sort_keys=True)
    if key not in _runs:
      workdir = str(runs_dir / str(len(_runs)))
      _runs[key] = _trained(small_config(workdir=workdir, **flat)) + (
          workdir,)
    return _runs[key]

  return run


@pytest.mark.parametrize("stage,row", MATRIX)
def test_each_stage_equals_unsharded_and_rolls_back(shared, stage, row):
  reference = shared(**_flat(row))[0]
  sharded, _, rolled_back, _ = shared(**_flat(row, shard=stage))
  assert max_diff(reference, sharded) <= 1e-6
  # The replayed steps repeat the first ones; on the stage-3 bf16 row bit
  # for bit (a sharded run is deterministic).
  exact = (stage, row) == ("weights", "sgd_bf16_2")
  assert max_diff(sharded, rolled_back) <= (0 if exact else 1e-6)


def test_adamw_decays_and_shards_alike(shared, small_config, tmp_path):
  adam = shared(**_flat("adam_4"))[0]
  flat = _flat("adam_4", optimizer="adamw", num_devices=2)
  unsharded = _trained(small_config(workdir=str(tmp_path / "none"),
                                    **flat))[0]
  sharded = _trained(small_config(workdir=str(tmp_path / "weights"),
                                  shard="weights", **flat))[0]
  assert max_diff(unsharded, sharded) <= 1e-6
  # The decay is applied: Keras' 0.004 x the learning rate of the weights,
  # per step, is ~4e-4 after 6 steps, far above what Adam on 4 replicas
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
  """`train.run` of ADAM_4's settings to `steps` in `workdir`:
  (variables, summary)."""
  config = small_config(workdir=workdir, train_steps=steps,
                        checkpoint_every=HALF, eval_every=HALF,
                        steps_per_loop=HALF, log_every=HALF,
                        allow_config_change=True,
                        **_flat("adam_4", **flat))
  summary = train.run(config)
  return checkpoint_variables(config), summary


def _checkpoint_values(workdir):
  path = os.path.join(workdir, "checkpoints", f"ckpt-{HALF}")
  return {key: tf.train.load_variable(path, key)
          for key, _ in tf.train.list_variables(path)
          if key.startswith(("optimizer/", "model/"))}


def test_checkpoints_move_between_stages_replica_counts_and_modes(
    shared, small_config, tmp_path):
  """One chain, each run resuming the last one's checkpoint: stage 3 on 4
  replicas (the matrix's run, at step HALF) -> another mode on 1 -> stage 2
  on 2, against the matrix's unsharded run on 4."""
  at_end, _, _, unsharded = shared(**_flat("adam_4"))
  weights = shared(**_flat("adam_4", shard="weights"))[-1]
  # The sharded checkpoint is an unsharded one: the same names, shapes
  # (stage 3 pads the 10-wide variables to 12 on 4 replicas) and values,
  # slot for slot.
  expected, got = _checkpoint_values(unsharded), _checkpoint_values(weights)
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


def test_memory_and_bytes_follow_the_formulas(shared):
  """Read from the matrix's runs of ADAM_4 (Adam, 4 replicas)."""
  seen = {stage: shared(**_flat(
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
