"""A decoder-only, pre-LayerNorm causal Transformer over bytes.

The model is a flat list of layers, like every model here, so the pipeline
mode can cut it between blocks:

    embed (token + learned position) | block_0 ... block_{L-1} | final_norm | head

Input: int token ids of shape (seq_len,), read from the dataset's input shape
(the position table has seq_len rows). Output: logits (seq_len, vocab). The
input and output embeddings are separate variables (untied), so no variable
is shared between pipeline stages.

Attention is `keras.layers.MultiHeadAttention` with its causal mask. A
hand-written attention (one fused q/k/v projection, then einsums or batched
matmuls) was measured against it on CPU, and a training step with it took
10-15% more CPU time, so the Keras layer stays.
"""

import dataclasses

import keras
import tensorflow as tf

from dist_loop.core.errors import UserError
from dist_loop.core.options import option
from dist_loop.models.base import MODELS

INIT_STDDEV = 0.02  # GPT-2's initialisation of every weight matrix.
LAYER_NORM_EPSILON = 1e-5


@dataclasses.dataclass(frozen=True)
class TransformerOptions:
  """The shape of the Transformer (`--model=transformer`)."""

  num_layers: int = option(4, "Transformer blocks.", lower=1, layout=True)
  d_model: int = option(128, "Width of the residual stream.", lower=1,
                        layout=True)
  num_heads: int = option(4, "Attention heads; must divide --d_model.",
                          lower=1, layout=True)
  mlp_ratio: int = option(4, "MLP hidden width, in multiples of --d_model.",
                          lower=1, layout=True)
  dropout: float = option(0.0, "Dropout rate after attention and the MLP "
                          "(training only).", lower=0.0, upper=0.99)

  def __post_init__(self):
    if self.num_heads >= 1 and self.d_model % self.num_heads:
      raise UserError(f"--d_model={self.d_model} is not divisible by "
                      f"--num_heads={self.num_heads}; use a --num_heads that "
                      "divides it")


def _dense(units, name, **kwargs):
  return keras.layers.Dense(
      units, name=name,
      kernel_initializer=keras.initializers.RandomNormal(stddev=INIT_STDDEV),
      **kwargs)


@tf.custom_gradient
def _lookup(table, ids):
  """`tf.gather(table, ids)`, whose gradient is a dense [vocab, d] tensor.

  The gradient of a plain gather is `IndexedSlices` with one row per token,
  larger than the table at a vocabulary of 256, and not a tensor that every
  mode can sum, all-reduce and accumulate like the others.
  """
  def grad(dy):
    return tf.math.unsorted_segment_sum(dy, ids, tf.shape(table)[0]), None
  return tf.gather(table, ids), grad


class Embed(keras.layers.Layer):
  """Token ids -> token embedding + learned position embedding.

  The sum is taken in float32 (the variables' dtype, no autocast), so the
  gradients summed over every token stay float32 under mixed precision;
  the output is in the compute dtype.
  """

  def __init__(self, vocab_size: int, d_model: int, **kwargs):
    super().__init__(autocast=False, **kwargs)
    self.vocab_size, self.d_model = vocab_size, d_model

  def build(self, input_shape):
    init = keras.initializers.RandomNormal(stddev=INIT_STDDEV)
    self.tokens = self.add_weight((self.vocab_size, self.d_model), init,
                                  name="tokens")
    self.positions = self.add_weight((input_shape[-1], self.d_model), init,
                                     name="positions")

  def call(self, ids):
    x = _lookup(self.tokens.value, tf.cast(ids, tf.int32))
    return tf.cast(x + self.positions.value, self.compute_dtype)


class Block(keras.layers.Layer):
  """x + attention(norm(x)), then x + mlp(norm(x)): a pre-LN block."""

  def __init__(self, d_model: int, num_heads: int, mlp_ratio: int,
               dropout: float, **kwargs):
    super().__init__(**kwargs)
    self.norm_1 = keras.layers.LayerNormalization(
        epsilon=LAYER_NORM_EPSILON, name="norm_1")
    self.attention = keras.layers.MultiHeadAttention(
        num_heads, d_model // num_heads, name="attention",
        kernel_initializer=keras.initializers.RandomNormal(stddev=INIT_STDDEV))
    self.norm_2 = keras.layers.LayerNormalization(
        epsilon=LAYER_NORM_EPSILON, name="norm_2")
    self.mlp_in = _dense(mlp_ratio * d_model, "mlp_in", activation="gelu")
    self.mlp_out = _dense(d_model, "mlp_out")
    # No dropout layer (and no random-seed state) unless it is used.
    self.dropout = (keras.layers.Dropout(dropout, name="dropout")
                    if dropout > 0 else None)

  def build(self, input_shape):
    self.attention.build(input_shape, input_shape)
    for layer in (self.norm_1, self.norm_2, self.mlp_in):
      layer.build(input_shape)
    self.mlp_out.build(tuple(input_shape[:-1]) + (self.mlp_in.units,))

  def _drop(self, x, training):
    return x if self.dropout is None else self.dropout(x, training=training)

  def call(self, x, training=None):
    h = self.norm_1(x)
    x = x + self._drop(self.attention(h, h, use_causal_mask=True), training)
    return x + self._drop(self.mlp_out(self.mlp_in(self.norm_2(x))), training)


@MODELS.register("transformer")
def transformer(input_shape, num_classes, options=None):
  """embed, num_layers blocks, final norm, head: num_layers + 3 layers.

  Args:
    input_shape: (seq_len,) token ids.
    num_classes: the vocabulary (256 for bytes): embedding rows and logits.
    options: `TransformerOptions`; None: the defaults.
  """
  del input_shape  # Embed reads seq_len when it is built.
  o = options or TransformerOptions()
  return ([Embed(num_classes, o.d_model, name="embed")]
          + [Block(o.d_model, o.num_heads, o.mlp_ratio, o.dropout,
                   name=f"block_{i}") for i in range(o.num_layers)]
          + [keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPSILON,
                                             name="final_norm"),
             _dense(num_classes, "head")])


def split_points(num_stages: int, num_layers: int):
  """The Transformer's own cut into `num_stages` pipeline stages.

  Stage 0 holds the embedding and the first blocks, the last stage the last
  blocks, the final norm and the head; the blocks are spread as evenly as
  possible. When they do not divide evenly, the spare blocks go to the
  middle stages first (they hold nothing else), then to the first stage.

  Args:
    num_stages: K.
    num_layers: the model's layer count (blocks + 3).

  Returns:
    K-1 layer indices where stages 1..K-1 start, or None if there are fewer
    blocks than stages (then the pipeline balances measured time).
  """
  blocks = num_layers - 3
  if not 1 <= num_stages <= blocks:
    return None
  counts = [blocks // num_stages] * num_stages
  spare = blocks % num_stages
  order = list(range(1, num_stages - 1)) + [0]
  for k in order[:spare]:
    counts[k] += 1
  points, start = [], 1  # Layer 0 is the embedding.
  for count in counts[:-1]:
    start += count
    points.append(start)
  return tuple(points)


transformer.Options = TransformerOptions
transformer.input_dtype = "int32"
transformer.input_rank = 1
transformer.task = "language_model"
transformer.split_points = split_points
