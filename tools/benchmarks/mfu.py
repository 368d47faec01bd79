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

from dist_loop import Config, devices  # pylint: disable=g-import-not-at-top
from dist_loop.data.base import DATASETS, Dataset  # pylint: disable=g-import-not-at-top
from dist_loop.models.base import MODELS  # pylint: disable=g-import-not-at-top
from dist_loop.modes import build_trainer  # pylint: disable=g-import-not-at-top
from tools.benchmarks.common import interleaved_medians, markdown_table  # pylint: disable=g-import-not-at-top

WIDTH = 2048
DEPTH = 4
CLASSES = 10
BATCH = 512
MATMUL_N = 2048
STEPS_PER_LOOP = 5


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
  x = rng.randn(4 * BATCH, WIDTH).astype(np.float32)
  y = rng.randint(0, CLASSES, len(x)).astype(np.int32)
  return Dataset(x, y, x[:BATCH], y[:BATCH], CLASSES)


def train_flops_per_step(batch, widths):
  """Matmul FLOPs of one training step of a Dense stack `widths[0] -> ...`."""
  flops = 0
  for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
    matmul = 2 * batch * fan_in * fan_out
    flops += matmul * (2 if i == 0 else 3)  # Forward, dW, and dX if needed.
  return flops


def run(quick: bool = False) -> dict:
  names = devices.configure(1, "cpu")
  chain, rounds, loops = (4, 1, 1) if quick else (20, 5, 4)

  a = tf.random.normal([MATMUL_N, MATMUL_N])
  b = tf.random.normal([MATMUL_N, MATMUL_N]) / np.sqrt(MATMUL_N)

  @tf.function
  def matmuls():
    x = a
    for _ in tf.range(chain):
      x = tf.matmul(x, b)  # Each depends on the last: nothing is skipped.
    return tf.reduce_sum(x)

  matmuls()
  config = Config(workdir="/tmp/unused", dataset="bench_features_2048",
                  model="bench_mlp_4x2048", num_devices=1,
                  global_batch_size=BATCH, optimizer="sgd",
                  learning_rate=1e-3, steps_per_loop=STEPS_PER_LOOP).validate()
  trainer = build_trainer(config, names,
                          DATASETS.get(config.dataset)(None, 0, None))
  trainer.train(STEPS_PER_LOOP)

  def train():
    for _ in range(loops):
      trainer.train(STEPS_PER_LOOP)

  seconds = interleaved_medians(
      {"matmul": lambda: float(matmuls()), "train": train}, rounds)
  peak = chain * 2 * MATMUL_N ** 3 / seconds["matmul"]
  flops = train_flops_per_step(BATCH, [WIDTH] * (DEPTH + 1) + [CLASSES])
  achieved = loops * STEPS_PER_LOOP * flops / seconds["train"]
  rows = [{"matmul peak GFLOP/s": peak / 1e9,
           "train GFLOP/s": achieved / 1e9, "MFU": achieved / peak,
           "model": f"{DEPTH}x{WIDTH} MLP, batch {BATCH}, SGD"}]
  columns = ["model", "matmul peak GFLOP/s", "train GFLOP/s", "MFU"]
  return {"rows": rows, "table": markdown_table(rows, columns)}


if __name__ == "__main__":
  print(run(quick="--quick" in sys.argv)["table"])
