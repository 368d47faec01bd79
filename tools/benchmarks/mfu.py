r"""Compute efficiency: training FLOP/s against the matmul peak.

    python -m tools.benchmarks.mfu [--quick]

The peak is what this machine reaches on a chain of square float32 matmuls
in a `tf.function`, measured in the same run, interleaved with the models.
Both models are trained by `SyncTrainer` on one device with SGD, and their
FLOPs per step are counted from the shapes. MFU = model FLOP/s / peak FLOP/s.

* An MLP, 4 x Dense(2048, relu) on 2048 features: a forward matmul costs
  2*B*in*out, the backward two more of the same size (gradients of the input
  and of the weights), except the first layer, whose input needs no gradient.
* The byte Transformer (`--model=transformer`), L blocks of width d, MLP
  ratio r, on windows of T bytes, vocabulary V, B windows a step. Per token
  and block, the forward matmuls cost 2*4*d*d (the q, k, v and output
  projections) + 2*2*r*d*d (the MLP) + 2*2*T*d (the scores q.k over the T
  keys, and the weighted sum of the values; the causal mask hides half of
  them, but the layer computes them all); the head costs 2*d*V. Training is
  3x the forward (the gradients of the inputs and of the weights). The
  embedding is a lookup, not a matmul, and is not counted:
      FLOPs/step = 3 * B*T * (L*(8*d*d + 4*r*d*d + 4*T*d) + 2*d*V).

Bias adds, activations, layer norms, softmax and the update are not counted,
so they show up as lost efficiency, as they should.
"""

import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from dist_loop.data import DATASETS, Dataset  # pylint: disable=g-import-not-at-top
from dist_loop.models import MODELS  # pylint: disable=g-import-not-at-top
from dist_loop.runtime import devices  # pylint: disable=g-import-not-at-top
from tools.benchmarks.common import interleaved_times, markdown_table, spread, trainer  # pylint: disable=g-import-not-at-top

WIDTH = 2048
DEPTH = 4
CLASSES = 10
# The Transformer at a compute-heavy size: (layers, d, heads, T, batch);
# with quick, a tiny one.
TRANSFORMER = {False: (4, 256, 4, 128, 16), True: (1, 32, 2, 16, 4)}
VOCAB = 256
# (batch, matmul side, matmuls in the chain, steps per loop, loops, rounds).
# Quick is a smoke run of the harness: too small to keep the cores busy.
SIZES = {False: (512, 2048, 20, 5, 4, 5), True: (32, 512, 2, 1, 1, 1)}
EXAMPLES = 2048


# Registered like any extension: one builder, one dataset, one name each.
@MODELS.register("bench_mlp_4x2048")
def bench_mlp(input_shape, num_classes):
  del input_shape
  return ([keras.layers.Dense(WIDTH, activation="relu") for _ in range(DEPTH)]
          + [keras.layers.Dense(num_classes)])


@DATASETS.register("bench_features_2048")
def bench_features(data_dir, seed, image_size=None):
  del data_dir, image_size
  rng = np.random.RandomState(seed)
  x = rng.randn(EXAMPLES, WIDTH).astype(np.float32)
  y = rng.randint(0, CLASSES, len(x)).astype(np.int32)
  return Dataset(x, y, x[:256], y[:256], CLASSES)


@DATASETS.register("bench_bytes")
def bench_bytes(data_dir, seed, image_size=None):
  """Random byte windows of the Transformer's T (set by `_set_seq_len`)."""
  del data_dir, image_size
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, VOCAB, (256, _SEQ_LEN[0] + 1)).astype(np.int32)
  x, y = tokens[:, :-1], tokens[:, 1:]
  return Dataset(x, y, x[:16], y[:16], VOCAB, task="language_model")


# What each takes and gives (dist_loop/models/base.py, data/base.py).
bench_mlp.input_rank = bench_features.input_rank = 1
bench_bytes.input_rank, bench_bytes.input_dtype = 1, "int32"
bench_bytes.task = "language_model"

_SEQ_LEN = [128]


def transformer_flops_per_step(batch, seq_len, layers, d, mlp_ratio=4,
                               vocab=VOCAB):
  """Matmul FLOPs of one training step of the Transformer (see above)."""
  per_block = 8 * d * d + 4 * mlp_ratio * d * d + 4 * seq_len * d
  return 3 * batch * seq_len * (layers * per_block + 2 * d * vocab)


def train_flops_per_step(batch, widths):
  """Matmul FLOPs of one training step of a Dense stack `widths[0] -> ...`."""
  flops = 0
  for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
    matmul = 2 * batch * fan_in * fan_out
    flops += matmul * (2 if i == 0 else 3)  # Forward, dW, and dX if needed.
  return flops


def run(quick: bool = False) -> dict:
  names = devices.configure(1, "cpu")
  batch, side, chain, steps_per_loop, loops, rounds = SIZES[quick]

  a = tf.random.normal([side, side])
  b = tf.random.normal([side, side]) / np.sqrt(side)

  @tf.function(autograph=False)
  def matmuls():
    # Each depends on the last: nothing is skipped.
    _, x = tf.while_loop(lambda i, x: i < chain,
                         lambda i, x: (i + 1, tf.matmul(x, b)), (0, a))
    return tf.reduce_sum(x)

  matmuls()
  layers, d, heads, seq_len, lm_batch = TRANSFORMER[quick]
  _SEQ_LEN[0] = seq_len
  common = dict(num_devices=1, optimizer="sgd", learning_rate=1e-3,
                steps_per_loop=steps_per_loop)
  models = {
      "mlp": (trainer(names, dict(
          dataset="bench_features_2048", model="bench_mlp_4x2048",
          global_batch_size=batch, **common))[1],
              train_flops_per_step(batch, [WIDTH] * (DEPTH + 1) + [CLASSES]),
              f"{DEPTH}x{WIDTH} MLP, batch {batch}, SGD"),
      "transformer": (trainer(names, dict(
          dataset="bench_bytes", model="transformer", num_layers=layers,
          d_model=d, num_heads=heads, mlp_ratio=4,
          global_batch_size=lm_batch, **common))[1],
                      transformer_flops_per_step(lm_batch, seq_len, layers, d),
                      f"Transformer L={layers} d={d} T={seq_len}, batch "
                      f"{lm_batch}, SGD")}

  def looped(sync):
    sync.train(steps_per_loop)  # Traces.

    def train():
      for _ in range(loops):
        sync.train(steps_per_loop)
    return train

  variants = {"matmul": lambda: float(matmuls())}
  variants.update({name: looped(m[0]) for name, m in models.items()})
  times = interleaved_times(variants, rounds)
  # Per round: the round's peak, and each model against it; then the
  # medians over the rounds and their min-max spread.
  peaks = [chain * 2 * side ** 3 / s for s in times["matmul"]]
  rows = []
  for name, (sync, flops, label) in models.items():
    sync.close()
    achieved = [loops * steps_per_loop * flops / s for s in times[name]]
    mfu = [a / p for a, p in zip(achieved, peaks)]
    rows.append({"model": label,
                 "matmul peak GFLOP/s": statistics.median(peaks) / 1e9,
                 "peak spread": spread([p / 1e9 for p in peaks]),
                 "train GFLOP/s": statistics.median(achieved) / 1e9,
                 "train spread": spread([a / 1e9 for a in achieved]),
                 "MFU": statistics.median(mfu), "MFU spread": spread(mfu),
                 "rounds": rounds})
  columns = ["model", "matmul peak GFLOP/s", "peak spread", "train GFLOP/s",
             "train spread", "MFU", "MFU spread"]
  return {"rows": rows, "table": markdown_table(rows, columns)}


if __name__ == "__main__":
  print(run(quick="--quick" in sys.argv)["table"])
