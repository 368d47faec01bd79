r"""What a Dense layer's products cost when the batch is cut into pieces.

    python -m tools.benchmarks.pieces [--quick]

The pipeline's ideal speed-up assumes that a micro-batch costs 1/M of the
batch. A Dense layer's training step runs three products: the forward
`x·W`, and the two of TensorFlow's gradient of `MatMul`, the input
gradient `dy·Wᵀ` and the weight gradient `xᵀ·dy`; over micro-batches the
weight gradients are also summed. This times each product, and the weight
gradient with its sum, on the whole batch against the same rows in M
pieces, with `deep_mlp`'s weights and the pipeline suite's batch, on one
thread (the suite's one-worker setting), in interleaved rounds: per round,
the pieces' seconds over the whole's. Each variant is one `tf.function`
over four layers' worth of products, so that the kernels, not the call,
are timed.

`pipeline_bench` runs it in a child process (`measure`) that pins itself
to one core: TensorFlow's thread counts can only be set before its runtime
starts.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

PRODUCTS = ("forward", "input gradient", "weight gradient",
            "weight gradient summed")
LAYERS = 4
# (rows, width, piece counts, rounds, calls per round); quick checks the
# harness only.
SIZES = {False: (1024, 512, (8, 16), 9, 10), True: (64, 32, (2,), 1, 1)}
TIMEOUT_S = 600.0


def _variants(rows: int, width: int, pieces: Sequence[int]):
  """(product, M) -> a function of no arguments; M=1 is the whole batch."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  random = tf.random.Generator.from_seed(0)
  ws = [random.normal([width, width]) for _ in range(LAYERS)]
  # The weight gradient's operands differ per layer, so that no product
  # repeats another (which the graph optimizer would merge).
  xs = [random.normal([rows, width]) for _ in range(LAYERS)]
  dys = [random.normal([rows, width]) for _ in range(LAYERS)]

  def chain(m, transpose_b):
    total = tf.constant(0.0)
    for h in tf.split(xs[0], m):
      for w in ws:
        h = tf.matmul(h, w, transpose_b=transpose_b)
      total += tf.reduce_sum(h[:, :1])  # Every row's: the whole's sum.
    return total

  def weight_gradients(m, summed):
    total = tf.constant(0.0)
    for x, dy in zip(xs, dys):
      grads = [tf.matmul(a, b, transpose_a=True)
               for a, b in zip(tf.split(x, m), tf.split(dy, m))]
      # Summed: one gradient of the whole batch, as a pipeline accumulates
      # it; else each piece's product alone (every one still computed).
      for grad in [tf.add_n(grads)] if summed else grads:
        total += tf.reduce_sum(grad[:1, :1])
    return total

  bodies = {"forward": lambda m: chain(m, False),
            "input gradient": lambda m: chain(m, True),
            "weight gradient": lambda m: weight_gradients(m, False),
            "weight gradient summed": lambda m: weight_gradients(m, True)}
  out = {}
  for product, body in bodies.items():
    for m in (1,) + tuple(pieces):
      fn = tf.function(lambda body=body, m=m: body(m), autograph=False)
      fn()  # Traces.
      out[(product, m)] = fn
  return out


def run(quick: bool = False) -> Dict:
  """Times the products in this process (set its threads first); returns
  {"rows", "width", "pieces": {M: {product: per-round ratios}}}."""
  rows, width, pieces, rounds, calls = SIZES[quick]
  fns = _variants(rows, width, pieces)
  seconds = {key: [] for key in fns}
  for _ in range(rounds):
    for key, fn in fns.items():
      t0 = time.perf_counter()
      for _ in range(calls):
        fn()
      seconds[key].append(time.perf_counter() - t0)
  return {"rows": rows, "width": width, "quick": quick, "pieces": {
      m: {product: [p / w for p, w in zip(seconds[(product, m)],
                                          seconds[(product, 1)])]
          for product in PRODUCTS} for m in pieces}}


def measure(quick: bool = False, core: Optional[int] = None) -> Dict:
  """`run` in a child process on one thread, pinned to `core` (None: not
  pinned), which dies with this process. The child pins itself, before it
  imports TensorFlow (no code runs between fork and exec). Raises
  RuntimeError if it fails or outlives TIMEOUT_S."""
  cmd = [sys.executable, "-m", "tools.benchmarks.pieces", "--json"]
  cmd += ["--quick"] if quick else []
  cmd += [] if core is None else [f"--core={core}"]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"the products benchmark took over {TIMEOUT_S:g} s"
                       ) from e
  if done.returncode:
    tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
    raise RuntimeError(f"the products benchmark failed (exit "
                       f"{done.returncode}): {tail[0]}")
  printed = done.stdout.strip().splitlines()
  if not printed:
    raise RuntimeError("the products benchmark printed no result")
  out = json.loads(printed[-1])
  out["pieces"] = {int(m): v for m, v in out["pieces"].items()}
  return out


def measure_or_why(quick: bool = False, core: Optional[int] = None) -> Dict:
  """`measure`, or {"error": why} if it failed: a suite's other results
  stand without it."""
  try:
    return measure(quick, core)
  except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as e:
    return {"error": str(e)}


def lines(result: Dict) -> List[str]:
  """One line per piece count: each product's median and the rounds'
  min-max; one line saying why where it was not measured."""
  if "error" in result:
    return [f"- a Dense layer's products in pieces: not measured "
            f"({result['error']})"]
  if result.get("quick"):
    return ["- a Dense layer's products in pieces: not measured (--quick's "
            "sizes only check the harness)"]
  out = []
  for m, ratios in sorted(result["pieces"].items()):
    rows = result["rows"] // m
    parts = ", ".join(
        f"{product} {statistics.median(r):.3f}x (rounds {min(r):.3f}-"
        f"{max(r):.3f})" for product, r in ratios.items())
    out.append(f"- a Dense layer's products ({result['width']}x"
               f"{result['width']} weights, one thread) on {m} pieces of "
               f"{rows} rows against {result['rows']} rows whole: {parts}")
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="a smoke run of the harness")
  parser.add_argument("--json", action="store_true",
                      help="print the result as one JSON line (the child "
                      "process `measure` starts)")
  parser.add_argument("--core", type=int, default=None,
                      help="pin this process to this core first")
  args = parser.parse_args(argv)
  from tools import local_cluster  # pylint: disable=g-import-not-at-top
  if args.json:  # Started by `measure`: it dies with the suite.
    local_cluster.die_with_parent()
  if args.core is not None:
    try:
      os.sched_setaffinity(0, {args.core})
    except (OSError, ValueError) as e:
      sys.exit(f"pieces: cannot run on core {args.core}: {e}")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # Each variant is a tf.function of its own, by design: no retracing
  # warnings about them.
  tf.get_logger().setLevel("ERROR")
  tf.config.threading.set_intra_op_parallelism_threads(1)
  tf.config.threading.set_inter_op_parallelism_threads(1)
  result = run(args.quick)
  print(json.dumps(result) if args.json else "\n".join(lines(result)))


if __name__ == "__main__":
  main()
