r"""Compute efficiency: a big MLP's training FLOP/s against the matmul peak.

    python -m tools.benchmarks.mfu [--quick]

The peak is what this machine reaches on a chain of square float32 matmuls
in a `tf.function`, measured in the same run. The model is 4 x Dense(2048,
relu) on 2048 features, trained by `SyncTrainer` on one device with SGD; its
FLOPs per step are counted from the layer shapes: a forward matmul costs
2*B*in*out, the backward two more of the same size (gradients of the input
and of the weights), except the first layer, whose input needs no gradient.
Bias adds, activations and the update are not counted, so they show up as
lost efficiency, as they should. MFU = model FLOP/s / peak FLOP/s.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from dist_loop import devices  # pylint: disable=g-import-not-at-top
from dist_loop.data import DATASETS, Dataset  # pylint: disable=g-import-not-at-top
from dist_loop.models import MODELS  # pylint: disable=g-import-not-at-top
from tools.benchmarks.common import interleaved_medians, markdown_table, trainer  # pylint: disable=g-import-not-at-top

WIDTH = 2048
DEPTH = 4
CLASSES = 10
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

  @tf.function
  def matmuls():
    x = a
    for _ in tf.range(chain):
      x = tf.matmul(x, b)  # Each depends on the last: nothing is skipped.
    return tf.reduce_sum(x)

  matmuls()
  _, sync = trainer(names, dict(
      dataset="bench_features_2048", model="bench_mlp_4x2048", num_devices=1,
      global_batch_size=batch, optimizer="sgd", learning_rate=1e-3,
      steps_per_loop=steps_per_loop))
  sync.train(steps_per_loop)

  def train():
    for _ in range(loops):
      sync.train(steps_per_loop)

  seconds = interleaved_medians(
      {"matmul": lambda: float(matmuls()), "train": train}, rounds)
  sync.close()
  peak = chain * 2 * side ** 3 / seconds["matmul"]
  flops = train_flops_per_step(batch, [WIDTH] * (DEPTH + 1) + [CLASSES])
  achieved = loops * steps_per_loop * flops / seconds["train"]
  rows = [{"matmul peak GFLOP/s": peak / 1e9,
           "train GFLOP/s": achieved / 1e9, "MFU": achieved / peak,
           "model": f"{DEPTH}x{WIDTH} MLP, batch {batch}, SGD"}]
  columns = ["model", "matmul peak GFLOP/s", "train GFLOP/s", "MFU"]
  return {"rows": rows, "table": markdown_table(rows, columns)}


if __name__ == "__main__":
  print(run(quick="--quick" in sys.argv)["table"])
