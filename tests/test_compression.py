"""Compression of the sync all-reduce (--allreduce_compression), equivalences
first.

* PowerSGD at full rank, top-k with fraction 1, and any compressor during
  PowerSGD's warm-up, sum exactly: the same variables as `none`.
* Error feedback: what a replica sends plus its new residual is its gradient
  plus its old residual, and what is sent is low-rank (PowerSGD) or k
  entries, the largest (top-k).
* A resumed run equals the uninterrupted one: every replica's state is in
  the checkpoint (one PowerSGD run, rank 1 after a warm-up, answers this and
  the warm-up's exactness).
* The bytes a run reports are those its traced step hands to the
  collectives (`helpers.handed_bytes`), and a cast sends half of float32.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import checkpoint_variables, max_diff, read_events
from dist_loop import configure, train
from dist_loop.core.errors import UserError
from dist_loop.parallel import compression
from dist_loop.runtime import checkpoints, devices
from dist_loop.runtime import strategy as strategy_lib
from dist_loop.runtime.cluster import Cluster
from dist_loop.runtime.summaries import LOGDIR
from helpers import handed_bytes, make_trainer, variables

STEPS = 12


def _handed(trainer) -> int:
  """Bytes one replica hands to the collectives in a step of `trainer`."""
  return sum(n for _, n in handed_bytes(trainer)[0])


def _train(config, steps=STEPS, halfway=None, measure=False):
  """(variables, summary) after `steps`; with a list `halfway`, the
  variables after `steps // 2` are appended to it; with `measure`, the
  summary also has `handed`, the bytes a step then hands over (`_handed`)."""
  trainer = make_trainer(config)
  trainer.train(steps // 2)
  if halfway is not None:
    halfway.append(variables(trainer))
  trainer.train(steps - steps // 2)
  summary = trainer.summary()
  if measure:
    summary["handed"] = _handed(trainer)
  out = variables(trainer), summary
  trainer.close()
  return out


@pytest.fixture(name="exact", scope="module")
def _exact():
  """Variables of float32 and float16 sync after STEPS (SGD, 2 replicas),
  and of float32 after STEPS // 2 ("halfway"); "bytes": what a float32 step
  hands to the collectives."""
  from dist_loop import make_config  # pylint: disable=g-import-not-at-top
  out, halfway = {}, []
  for precision in ("float32", "mixed_float16"):
    out[precision], summary = _train(make_config(
        workdir="/tmp/unused", dataset="synthetic", model="mlp",
        num_devices=2, global_batch_size=32, optimizer="sgd",
        learning_rate=0.1, seed=0, precision=precision), halfway=halfway,
        measure=precision == "float32")
    out.setdefault("bytes", summary.get("handed"))
  out["halfway"] = halfway[0]
  return out


@pytest.mark.parametrize("flags, counted", [
    # Rank 10 is the full rank of both kernels of the MLP (10x128, 128x10).
    (dict(allreduce_compression="powersgd", powersgd_rank=10), True),
    (dict(allreduce_compression="powersgd", powersgd_rank=10,
          precision="mixed_float16"), False),
    (dict(allreduce_compression="topk", topk_fraction=1.0), True),
], ids=["powersgd_full_rank", "powersgd_float16", "topk_1"])
def test_exact_settings_equal_the_exact_all_reduce(small_config, exact,
                                                   flags, counted):
  precision = flags.get("precision", "float32")
  trained, summary = _train(small_config(num_devices=2, **flags),
                            measure=counted)
  assert max_diff(trained, exact[precision]) <= 1e-5
  if counted:  # The compressed path ran, and was counted as it sends.
    assert summary["allreduce_bytes_per_step"] == summary["handed"]
  if flags["allreduce_compression"] == "topk":  # Each entry and its index.
    assert summary["handed"] > exact["bytes"]


def test_lossy_top_k_differs_from_exact(small_config, exact):
  """The equalities above are not of compression switched off."""
  trained, _ = _train(small_config(num_devices=2,
                                   allreduce_compression="topk",
                                   topk_fraction=0.01))
  assert max_diff(trained, exact["float32"]) > 1e-3


def test_the_extension_compressor_trains_alike_on_any_replica_count(
    small_config, exact):
  """experiments/extensions/randomk.py: one class, one registration, and
  its own option, `--randomk_fraction`."""
  from experiments.extensions import randomk  # pylint: disable=g-import-not-at-top
  assert compression.COMPRESSORS.get("randomk") is randomk.RandomK
  fraction = 0.1
  one, _ = _train(small_config(num_devices=1, reducer="randomk",
                               randomk_fraction=fraction))
  two, summary = _train(small_config(num_devices=2, reducer="randomk",
                                     randomk_fraction=fraction), measure=True)
  assert max_diff(one, two) <= 1e-5
  assert max_diff(two, exact["float32"]) > 1e-3
  assert summary["allreduce_bytes_per_step"] == summary["handed"]
  assert summary["handed"] < exact["bytes"] / 5


# -- error feedback, on one reduce of known gradients --

def _reduce_twice(compressor, grads, residuals):
  """Two replicas: replica r reduces grads[r] with residuals[r] (both lists
  over the compressor's tensors / matrices), twice in a row, the second
  from the first's state. Returns, per call and replica, (out, state)."""
  strategy = strategy_lib.mirrored(devices.configure(2, "cpu"))
  initial = compressor.initial_state()
  stacked = [tf.constant(np.stack(g)) for g in zip(*grads)]
  stacked_e = [tf.constant(np.stack(e)) for e in zip(*residuals)]

  def replica():
    r = tf.distribute.get_replica_context().replica_id_in_sync_group
    state = {**initial, "residual": [tf.gather(e, r) for e in stacked_e]}
    state = tf.nest.map_structure(tf.convert_to_tensor, state)
    mine = [tf.gather(g, r) for g in stacked]
    first = compressor.reduce(mine, state, tf.constant(0, tf.int64))
    second = compressor.reduce(mine, first[1], tf.constant(1, tf.int64))
    return first, second

  results = tf.function(lambda: strategy.run(replica), autograph=False)()
  per_replica = [tf.nest.map_structure(
      lambda v, r=r: np.asarray(strategy.experimental_local_results(v)[r]),
      results) for r in range(2)]
  # [call][replica] of (out, state).
  return [[per_replica[r][call] for r in range(2)] for call in range(2)]


def _random(shapes, seed):
  rng = np.random.RandomState(seed)
  return [[rng.standard_normal(s).astype(np.float32) for s in shapes]
          for _ in range(2)]


@pytest.mark.parametrize("flags", [
    dict(powersgd_rank=2),
    dict(topk_fraction=0.05),
])
def test_error_feedback_sends_gradient_plus_residual(flags):
  kind = (compression.powersgd.PowerSGD if "powersgd_rank" in flags
          else compression.topk.TopK)
  shapes = [(64, 32), (32,)]  # A matrix and a vector (sent exactly).
  compressor = compression.make(
      kind, kind.Options(**flags),
      [tf.TensorSpec(s, tf.float32) for s in shapes])
  grads = _random(shapes, 1)
  residuals = [[0.1 * e for e in r[:1]] for r in _random(shapes, 2)]
  for call in _reduce_twice(compressor, grads, residuals):
    outs = [out for out, _ in call]
    np.testing.assert_array_equal(outs[0][0], outs[1][0])  # Alike.
    np.testing.assert_allclose(outs[0][1], grads[0][1] + grads[1][1],
                               rtol=1e-6)
    sent = [grads[r][0] + residuals[r][0] - call[r][1]["residual"][0]
            for r in range(2)]
    # Sent + new residual = gradient + old residual, and the sum of what
    # was sent is the result.
    np.testing.assert_allclose(sent[0] + sent[1], outs[0][0], atol=1e-5)
    for r in range(2):
      if "powersgd_rank" in flags:
        singular = np.linalg.svd(sent[r], compute_uv=False)
        assert np.all(singular[2:] < 1e-4 * singular[0])  # Rank 2.
      else:
        k = int(np.ceil(0.05 * sent[r].size))
        nonzero = np.flatnonzero(sent[r])
        assert len(nonzero) == k
        wanted = np.abs(grads[r][0] + residuals[r][0]).ravel()
        assert wanted[nonzero].min() >= np.sort(wanted)[-k]  # The largest.
    residuals = [[call[r][1]["residual"][0]] for r in range(2)]


def test_powersgd_keeps_q_from_step_to_step():
  kind = compression.powersgd.PowerSGD
  compressor = compression.make(kind, kind.Options(powersgd_rank=2),
                                [tf.TensorSpec((64, 32))])
  grads = _random([(64, 32)], 3)
  zero = [[np.zeros((64, 32), np.float32)]] * 2
  first, second = _reduce_twice(compressor, grads, zero)
  q0 = compressor.initial_state()["q"][0]
  q1, q2 = first[0][1]["q"][0], second[0][1]["q"][0]
  # Q = SUM_i M_i^T P with P orthonormal: M's power iteration moves on.
  assert q1.shape == q0.shape == (32, 2)
  assert max_diff([q1], [q0]) > 1e-2 and max_diff([q2], [q1]) > 1e-2
  np.testing.assert_array_equal(q1, first[1][1]["q"][0])  # Alike.


# -- resume, TensorBoard and summary.json --

def test_warm_up_is_exact_then_a_resume_equals_the_uninterrupted_run(
    small_config, exact):
  """During PowerSGD's warm-up every compressor sums exactly, and its bytes
  are float32's; rank 1 after it differs from exact. The uninterrupted run
  is a trainer that saves its checkpoint at step 9 (residuals far from
  zero) on its way to 12; `train.run` resumes from that save, so the
  controller's restore and its logging are the run's."""
  config = small_config(num_devices=2, allreduce_compression="powersgd",
                        powersgd_rank=1, powersgd_start_step=STEPS // 2,
                        train_steps=STEPS, steps_per_loop=3, log_every=3)
  whole = make_trainer(config)
  whole.train(STEPS // 2)
  assert max_diff(variables(whole), exact["halfway"]) <= 1e-5
  whole.train(3)
  checkpoints.Checkpointer(whole.checkpoint_items(), config.workdir,
                           1).save(9)
  residual = whole.reduction.compression_state.variables["residual"][0]
  assert np.abs(np.asarray(residual)).max() > 1e-3  # Saved far from 0.
  whole.train(3)
  assert max_diff(variables(whole), exact["float32"]) > 1e-3
  compressed = _handed(whole)  # Rank 1, as a step after the warm-up sends.
  assert compressed < exact["bytes"] / 5
  summary = train.run(config)
  assert summary["final_step"] == STEPS
  assert max_diff(variables(whole), checkpoint_variables(config)) <= 1e-6
  whole.close()
  # The warm-up's steps hand over float32's bytes, the others rank 1's.
  assert summary["allreduce_bytes_total"] == STEPS // 2 * (
      exact["bytes"] + compressed)
  assert summary["allreduce_bytes_per_step"] == (
      summary["allreduce_bytes_total"] / STEPS)
  events = read_events(os.path.join(config.workdir, LOGDIR))
  assert events["train/comm/bytes_per_step"] == {STEPS: compressed}
  assert events["train/comm/ratio_to_float32"][STEPS] == pytest.approx(
      compressed / exact["bytes"], rel=1e-6)


@pytest.mark.parametrize("flags, ratio", [
    (dict(), 1.0), (dict(allreduce_compression="bf16"), 0.5),
    (dict(reducer="cast", cast_dtype="fp16", num_devices=4), 0.5)])
def test_a_cast_hands_over_every_weight_at_its_wire_dtype(small_config, exact,
                                                          flags, ratio):
  """float32: 4 bytes per parameter of the model, all in the step's
  collectives; a 2-byte wire type half of that, at any replica count."""
  trainer = make_trainer(small_config(**{"num_devices": 2, **flags}))
  handed = _handed(trainer)
  assert exact["bytes"] == 4 * trainer.model.count_params()
  assert handed == ratio * exact["bytes"]
  assert trainer.summary()["allreduce_bytes_per_step"] == handed
  assert trainer.summary()["allreduce_ratio_to_float32"] == ratio
  assert trainer.report().scalars["comm/bytes_per_step"] == handed
  trainer.close()


# -- bad combinations --

@pytest.mark.parametrize("flags, message", [
    (dict(allreduce_compression="powersgd", powersgd_rank=0),
     "--powersgd_rank must be >= 1, got 0"),
    (dict(powersgd_rank=8),
     "--powersgd_rank is an option of --reducer=powersgd, which this run "
     "does not use; drop it"),
    (dict(allreduce_compression="topk", powersgd_start_step=5),
     "--powersgd_start_step is an option of --reducer=powersgd"),
    (dict(reducer="topk", topk_fraction=0.0),
     "--topk_fraction must be > 0, got 0.0"),
    (dict(allreduce_compression="int4"),
     "unknown --reducer='int4'; registered reducers: cast, exact, powersgd"),
    (dict(reducer="cast", allreduce_compression="powersgd"),
     "--reducer=cast and --allreduce_compression=powersgd --shard=none "
     "disagree"),
])
def test_bad_combinations_are_one_line_errors(small_config, flags, message):
  with pytest.raises(UserError, match=message) as error:
    configure.validate(small_config(num_devices=2, **flags), Cluster())
  assert "\n" not in str(error.value)


def test_an_old_flags_txt_with_every_compressor_option_is_accepted(
    small_config):
  """Before `--reducer`, flags.txt held every compressor's option at its
  default; with the old selector they are read as the reducer's."""
  config = configure.validate(small_config(
      allreduce_compression="none", shard="none", powersgd_rank=4,
      powersgd_start_step=0, topk_fraction=0.01, allreduce_bucket_mb=4.0),
                              Cluster())
  assert (config.reducer, config.reducer_options) == (
      "exact", compression.BucketOptions())
