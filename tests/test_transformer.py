"""The byte-level Transformer: causality, its pipeline split, and training
it in sync mode (a short run in mixed_float16 learns more than byte
frequencies; N devices equal 1 is in test_transformer_modes.py)."""

import numpy as np
import pytest
import tensorflow as tf

from dist_loop import models, train
from dist_loop.core.errors import UserError
from dist_loop.models.transformer import TransformerOptions

TINY = dict(num_layers=2, d_model=16, num_heads=2, mlp_ratio=2)


def _model(seq_len=12, **options):
  return models.build("transformer", (seq_len,), 256,
                      options=TransformerOptions(**{**TINY, **options}))


def test_logits_at_t_do_not_see_later_bytes():
  model = _model()
  ids = np.random.RandomState(0).randint(0, 256, (3, 12)).astype(np.int32)
  before = model(ids).numpy()
  for t in (0, 5, 10):
    changed = ids.copy()
    changed[:, t + 1:] = (changed[:, t + 1:] + 1) % 256
    after = model(changed).numpy()
    np.testing.assert_allclose(after[:, :t + 1], before[:, :t + 1], atol=1e-6)
    # The later positions do see the change: the model is not constant.
    assert np.abs(after[:, t + 1:] - before[:, t + 1:]).max() > 1e-4


def test_shape_and_layers_that_share_no_variable():
  model = _model(num_layers=3)
  assert [l.name for l in model.layers] == [
      "embed", "block_0", "block_1", "block_2", "final_norm", "head"]
  assert model(np.zeros((2, 12), np.int32)).shape == (2, 12, 256)
  owners = {}
  for layer in model.layers:
    for v in layer.trainable_variables:
      assert id(v) not in owners, (v.path, owners.get(id(v)))
      owners[id(v)] = layer.name
  # Untied: the input embedding and the output head are separate weights.
  embed, head = model.layers[0], model.layers[-1]
  assert embed.tokens.shape == (256, 16) and head.kernel.shape == (16, 256)


def test_gradients_are_dense_float32_under_mixed_precision():
  """Every gradient is a plain tensor (an embedding lookup's would be
  IndexedSlices), so every mode can sum, all-reduce and accumulate it."""
  model = models.build("transformer", (12,), 256, precision="mixed_bfloat16",
                       options=TransformerOptions(**TINY))
  ids = np.random.RandomState(1).randint(0, 256, (2, 12)).astype(np.int32)
  with tf.GradientTape() as tape:
    logits = model(ids, training=True)
    loss = tf.reduce_mean(tf.cast(logits, tf.float32) ** 2)
  grads = tape.gradient(loss, model.trainable_variables)
  assert logits.dtype == tf.bfloat16
  assert all(isinstance(g, tf.Tensor) and g.dtype == tf.float32
             for g in grads)
  # Only the rows of the bytes that occur get a gradient.
  rows = np.abs(grads[0].numpy()).sum(axis=1) > 0
  np.testing.assert_array_equal(np.flatnonzero(rows), np.unique(ids))


def test_dropout_acts_only_in_training():
  model = _model(dropout=0.5)
  ids = np.arange(24, dtype=np.int32).reshape(2, 12)
  np.testing.assert_array_equal(model(ids, training=False),
                                model(ids, training=False))
  assert np.abs(model(ids, training=True) - model(ids, training=False)
                ).max() > 1e-3


@pytest.mark.parametrize("num_layers,num_stages,expected", [
    (4, 2, (3,)),        # embed+2 | 2+norm+head
    (4, 4, (2, 3, 4)),   # one block per stage
    (5, 2, (4,)),        # the spare block goes to the first stage
    (7, 3, (3, 6)),      # ... or to a middle stage: 2 | 3 | 2
    (8, 3, (4, 7)),      # 3 | 3 | 2
])
def test_the_declared_split_balances_blocks(num_layers, num_stages, expected):
  points = models.split_points_for("transformer", num_stages, num_layers + 3)
  assert points == expected
  bounds = (0,) + points + (num_layers + 3,)
  blocks = [b - a for a, b in zip(bounds, bounds[1:])]
  blocks[0] -= 1  # The embedding.
  blocks[-1] -= 2  # The final norm and the head.
  assert max(blocks) - min(blocks) <= 1 and min(blocks) >= 1


def test_no_declared_split_for_more_stages_than_blocks():
  assert models.split_points_for("transformer", 3, 2 + 3) is None
  assert models.split_points_for("cnn", 2, 5) == (2,)  # Dicts still work.


def test_heads_must_divide_the_width():
  with pytest.raises(UserError, match=r"--d_model=30 is not divisible by "
                     r"--num_heads=4"):
    TransformerOptions(d_model=30, num_heads=4)


def _lm_config(small_config, **overrides):
  base = dict(dataset="pysource", model="transformer", seq_len=16,
              optimizer="adam", learning_rate=0.01, global_batch_size=16,
              **TINY)
  return small_config(**{**base, **overrides})


def test_a_short_run_learns_more_than_byte_frequencies(small_config):
  """In mixed_float16, with its dynamic loss scale: the Transformer's
  float16 run of test_transformer_modes.py (bfloat16 is there)."""
  config = _lm_config(small_config, num_layers=1, d_model=32, seq_len=32,
                      global_batch_size=32, learning_rate=0.01,
                      precision="mixed_float16", train_steps=150,
                      steps_per_loop=50, log_every=150, eval_every=150,
                      checkpoint_every=150)
  summary = train.run(config)
  from dist_loop.data import text  # pylint: disable=g-import-not-at-top
  counts = np.bincount(np.frombuffer(text.pysource_bytes(), np.uint8),
                       minlength=256)
  p = counts[counts > 0] / counts.sum()
  unigram_nats = float(-(p * np.log(p)).sum())  # 3.11 nats (4.49 bits).
  # It ends below 0.8 of it (0.80 after 100 steps, in float16 as in
  # float32): it has learnt which bytes follow which.
  assert summary["eval_loss"] < 0.8 * unigram_nats, summary
  np.testing.assert_allclose(summary["eval_bits_per_byte"],
                             summary["eval_loss"] / np.log(2), rtol=1e-6)
