r"""Compute efficiency: training FLOP/s against the matmul peak.

    python -m tools.benchmarks.mfu [--quick]
    python -m tools.benchmarks.mfu --profile_dir=DIR [--quick]

The peak is what this machine reaches on a chain of square float32 matmuls
in a `tf.function`, measured in the same run, interleaved with the models.
The same chain compiled with XLA runs XLA's own matmul kernels, which can
be slower than TensorFlow's (oneDNN's, where they are on): below the table,
its share of the peak, per round, is the most MFU a step with XLA reaches.
Both models are trained with SGD by `SyncTrainer` on 1 and 2 logical
devices, each with and without `--jit_compile`, and by Keras `fit` with
`jit_compile=True` on one device (the reference a Keras user gets), all
interleaved in the same rounds; their FLOPs per step are counted from the
shapes. MFU = model FLOP/s / peak FLOP/s; "vs fit xla" is fit's time over
ours in the same round (above 1: ours is faster). Each is a median over
the rounds, with the rounds' min-max.

Compile time: each loop's first call (the one that traces, and with XLA
compiles, before the rounds) against a steady call of the same steps (the
rounds' median): `first loop s` and `compile s`, their difference.

Below the table, the issue's targets, each met or not: MFU at least 0.85
for the MLP and 0.70 for the Transformer (every sync row), and our
one-device loop with XLA at least as fast as fit with XLA (1.0x).

`--profile_dir=DIR` instead profiles one step of the Transformer, without
and with XLA, and prints its top ops by self time (`profile_step.py`).

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

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from dist_loop import models as models_lib  # pylint: disable=g-import-not-at-top
from dist_loop.data import DATASETS, Dataset  # pylint: disable=g-import-not-at-top
from dist_loop.models import MODELS  # pylint: disable=g-import-not-at-top
from dist_loop.runtime import devices  # pylint: disable=g-import-not-at-top
from tools.benchmarks.common import config, interleaved_times, load_data, markdown_table, spread, trainer  # pylint: disable=g-import-not-at-top

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
# Our loops: (devices, --jit_compile), each beside Keras fit with XLA.
VARIANTS = ((1, False), (1, True), (2, False), (2, True))
FIT = "keras fit 1 device"
# The targets: each model's least MFU, and our one-device loop
# with XLA against fit with XLA (fit's time over ours).
MFU_TARGETS = {"mlp": 0.85, "transformer": 0.70}
VS_FIT_TARGET = 1.0


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


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def _keras_fit_xla(names, flat, split, steps_per_loop, loops):
  """The reference: Keras `fit` with `jit_compile=True` on one device, no
  strategy (under one, Keras turns XLA off), the same model, batch and SGD,
  `steps_per_execution` equal to our `steps_per_loop`. Returns (train, the
  first call's seconds)."""
  with tf.device(names[0]):
    model = models_lib.build_for(config(**flat), split)
    model.compile(optimizer=keras.optimizers.SGD(flat["learning_rate"]),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  steps_per_execution=steps_per_loop, jit_compile=True)
  dataset = tf.data.Dataset.from_tensor_slices(
      (split.train_x, split.train_y)).repeat().batch(
          flat["global_batch_size"], drop_remainder=True)
  first = _timed(lambda: model.fit(dataset, epochs=1,
                                   steps_per_epoch=steps_per_loop, verbose=0))

  def train():  # The call above traced and compiled.
    model.fit(dataset, epochs=1, steps_per_epoch=loops * steps_per_loop,
              verbose=0)
  return train, first


def _ours(names, flat, steps_per_loop, loops):
  """dist_loop's sync trainer, trained as the controller calls it.
  Returns (train, the trainer, the first call's seconds)."""
  sync = trainer(names, flat)[1]
  # Traces (and with XLA, compiles).
  first = _timed(lambda: sync.train(steps_per_loop))

  def train():
    for _ in range(loops):
      sync.train(steps_per_loop)
  return train, sync, first


def _models(quick: bool, batch: int, steps_per_loop: int) -> dict:
  """name -> (flat flags, matmul FLOPs per step, label)."""
  layers, d, heads, seq_len, lm_batch = TRANSFORMER[quick]
  _SEQ_LEN[0] = seq_len
  common = dict(optimizer="sgd", learning_rate=1e-3,
                steps_per_loop=steps_per_loop)
  models = {
      "mlp": (dict(dataset="bench_features_2048", model="bench_mlp_4x2048",
                   global_batch_size=batch, **common),
              train_flops_per_step(batch, [WIDTH] * (DEPTH + 1) + [CLASSES]),
              f"{DEPTH}x{WIDTH} MLP, batch {batch}, SGD"),
      "transformer": (dict(dataset="bench_bytes", model="transformer",
                           num_layers=layers, d_model=d, num_heads=heads,
                           mlp_ratio=4, global_batch_size=lm_batch, **common),
                      transformer_flops_per_step(lm_batch, seq_len, layers, d),
                      f"Transformer L={layers} d={d} T={seq_len}, batch "
                      f"{lm_batch}, SGD")}
  # Quick checks the harness: one model's loops, each traced once, do.
  return {"transformer": models["transformer"]} if quick else models


def run(quick: bool = False) -> dict:
  """MFU of each model in sync on 1 and 2 devices, with and without XLA,
  and of Keras fit with XLA on one device, all in the same rounds."""
  names = devices.configure(2, "cpu")
  batch, side, chain, steps_per_loop, loops, rounds = SIZES[quick]

  a = tf.random.normal([side, side])
  b = tf.random.normal([side, side]) / np.sqrt(side)

  def chain_of_matmuls():
    # Each depends on the last: nothing is skipped.
    _, x = tf.while_loop(lambda i, x: i < chain,
                         lambda i, x: (i + 1, tf.matmul(x, b)), (0, a))
    return tf.reduce_sum(x)

  # The peak, and the same chain compiled: XLA's own matmuls (not the
  # kernels TensorFlow runs without it), the most a compiled step reaches.
  matmuls = tf.function(chain_of_matmuls, autograph=False)
  xla_matmuls = tf.function(chain_of_matmuls, autograph=False,
                            jit_compile=True)
  matmuls(), xla_matmuls()
  variants = {"matmul": lambda: float(matmuls()),
              "xla matmul": lambda: float(xla_matmuls())}
  trainers, rows, first = [], [], {}
  for name, (flat, flops, label) in _models(quick, batch,
                                             steps_per_loop).items():
    for n, xla in VARIANTS:
      key = (name, f"sync {n} device{'s' if n > 1 else ''}", xla)
      variants[key], sync, first[key] = _ours(names[:n], dict(
          flat, num_devices=n, jit_compile=xla), steps_per_loop, loops)
      trainers.append(sync)
      rows.append((key, flops, label))
    key = (name, FIT, True)
    variants[key], first[key] = _keras_fit_xla(
        names, flat, load_data(config(**flat)), steps_per_loop, loops)
    rows.append((key, flops, label))
  times = interleaved_times(variants, rounds)
  for sync in trainers:
    sync.close()
  # Per round: the round's peak, and each variant against it and against
  # fit with XLA; then the medians over the rounds and their spread.
  peaks = [chain * 2 * side ** 3 / s for s in times["matmul"]]
  # XLA's chain against the peak, per round: the MFU a compiled step that
  # were nothing but matmuls would reach.
  xla_ceiling = [p / x for p, x in zip(times["matmul"], times["xla matmul"])]
  out = []
  for key, flops, label in rows:
    name, loop, xla = key
    achieved = [loops * steps_per_loop * flops / s for s in times[key]]
    mfu = [a / p for a, p in zip(achieved, peaks)]
    fit = times[(name, FIT, True)]
    vs_fit = [f / s for s, f in zip(times[key], fit)]
    steady = statistics.median(times[key]) / loops  # One call's steps.
    out.append({"name": name, "model": label, "loop": loop, "xla": xla,
                "matmul peak GFLOP/s": statistics.median(peaks) / 1e9,
                "peak spread": spread([p / 1e9 for p in peaks]),
                "train GFLOP/s": statistics.median(achieved) / 1e9,
                "train spread": spread([a / 1e9 for a in achieved]),
                "MFU": statistics.median(mfu), "MFU spread": spread(mfu),
                "vs fit xla": statistics.median(vs_fit),
                "vs fit xla spread": spread(vs_fit),
                "first loop s": first[key],
                "compile s": first[key] - steady, "rounds": rounds})
  columns = ["model", "loop", "xla", "matmul peak GFLOP/s", "peak spread",
             "train GFLOP/s", "train spread", "MFU", "MFU spread",
             "vs fit xla", "vs fit xla spread", "first loop s", "compile s"]
  ceiling = {"of peak": statistics.median(xla_ceiling),
             "spread": spread(xla_ceiling)}
  return {"rows": out, "xla_matmul": ceiling,
          "table": markdown_table(out, columns) + "\n\n"
          + "\n".join([ceiling_line(ceiling)] + targets(out))}


def ceiling_line(ceiling) -> str:
  """What XLA's own matmuls reach: the ceiling of every MFU with XLA."""
  share = ceiling["of peak"]
  return (f"- the same chain of matmuls compiled with XLA: {share:.3f} "
          f"({ceiling['spread']}) of the peak, the most MFU a step with XLA "
          "reaches")


def targets(rows) -> list:
  """The issue's targets, one line each, met or not (judged on medians)."""
  def verdict(value, least):
    return f"(target >= {least}): {'met' if value >= least else 'NOT met'}"

  lines = []
  for r in rows:
    if r["loop"] != FIT:
      lines.append(
          f"- {r['model']}, {r['loop']}, {'XLA' if r['xla'] else 'no XLA'}"
          f": MFU {r['MFU']:.3f} ({r['MFU spread']}) "
          + verdict(r["MFU"], MFU_TARGETS[r["name"]]))
  for r in rows:
    if r["loop"] == "sync 1 device" and r["xla"]:
      lines.append(
          f"- {r['model']}, sync 1 device, XLA: {r['vs fit xla']:.3f}x Keras "
          f"fit with XLA ({r['vs fit xla spread']}) "
          + verdict(r["vs fit xla"], VS_FIT_TARGET))
  return lines


def profile(profile_dir: str, quick: bool = False) -> dict:
  """Profiles one step of the Transformer on one device, without and with
  XLA (`profile_step.py`); prints and returns each one's top ops."""
  from tools.benchmarks import profile_step  # pylint: disable=g-import-not-at-top
  names = devices.configure(2, "cpu")
  flat = _models(quick, SIZES[quick][0], 1)["transformer"][0]
  out = {}
  for xla in (False, True):
    name = "transformer_xla" if xla else "transformer"
    _, sync = trainer(names[:1], dict(flat, num_devices=1, jit_compile=xla))
    path = profile_step.capture(lambda: sync.train(1),  # pylint: disable=cell-var-from-loop
                                os.path.join(profile_dir, name))
    sync.close()
    out[name] = profile_step.top_ops(path)
    print(f"## {name}: one step's top ops by self time ({path})\n\n"
          f"{profile_step.table(out[name])}\n", flush=True)
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes: checks the harness only")
  parser.add_argument("--profile_dir", default=None,
                      help="profile one Transformer step here instead")
  args = parser.parse_args(argv)
  if args.profile_dir is None:
    print(run(args.quick)["table"])
    return
  if not args.profile_dir or (os.path.exists(args.profile_dir)
                              and not os.path.isdir(args.profile_dir)):
    parser.error(f"--profile_dir={args.profile_dir!r} is not a directory; "
                 "name a new or an existing directory")
  profile(args.profile_dir, args.quick)


if __name__ == "__main__":
  main()
