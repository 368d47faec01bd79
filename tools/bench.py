r"""All benchmarks, side by side in one process run.

    python -m tools.bench --suite=all --out=bench.json [--quick]

`--suite` takes a comma-separated list of: overhead (our sync loop against
Keras fit and a bare loop), mfu (training FLOP/s against the matmul peak),
data_parallel (1/2/4 devices, packing, compression), async (stragglers),
pipeline (micro-batches and schedules), comm (bytes on the wire against
accuracy: compression, local SGD, DiLoCo), scale (1 worker against 2 pinned
worker processes and one process on the same cores), memory (sharded state
per device against ZeRO's formulas), or `all`. Prints a markdown table
per suite and writes everything, with the machine it ran on, to `--out` as
JSON.
`--quick` uses tiny sizes: a smoke run of the harness, not numbers to quote.
Benchmarks are not tests: the test suite asserts no timing.

The terminal shows the benchmark's own lines only; `--verbosity=1` adds
TensorFlow's warnings, `--verbosity=2` everything
(`dist_loop/runtime/console.py`).
"""

import importlib
import logging
import os
import platform
import sys
import time

from absl import app, flags

# Neither imports TensorFlow: `main` imports it, quietly, once the
# verbosity is known.
from dist_loop.runtime import console
from experiments import startup
from dist_loop.runtime.files import atomic_write_json

SUITES = {  # name -> module with run(quick) -> {"rows": [...], "table": str}
    "overhead": "tools.benchmarks.overhead",
    "mfu": "tools.benchmarks.mfu",
    "data_parallel": "tools.benchmarks.data_parallel",
    "async": "tools.benchmarks.async_bench",
    "pipeline": "tools.benchmarks.pipeline_bench",
    "comm": "tools.benchmarks.comm_bench",
    "scale": "tools.benchmarks.scale_bench",
    "memory": "tools.benchmarks.memory_bench",
    "input": "tools.benchmarks.input_bench",
    "goodput": "tools.benchmarks.goodput_bench",
}
# The in-process suites share one TensorFlow runtime: start it with enough
# logical devices for all of them (the pipeline suite runs in subprocesses).
NUM_DEVICES = 4

FLAGS = flags.FLAGS
flags.DEFINE_list("suite", ["all"], "Suites to run: all, or any of "
                  + ", ".join(SUITES) + ".")
flags.DEFINE_string("out", "bench.json", "Where the JSON results go.")
flags.DEFINE_bool("quick", False, "Tiny sizes: checks the harness only.")


@flags.validator("suite", message="unknown or no suite; choose one or "
                 "more of: all, " + ", ".join(SUITES))
def _known(names):
  return bool(names) and all(n == "all" or n in SUITES for n in names)


def machine() -> dict:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return {"platform": platform.platform(), "processor": platform.processor(),
          "cpu_count": os.cpu_count(), "python": platform.python_version(),
          "tensorflow": tf.__version__,
          "gpus": len(tf.config.list_physical_devices("GPU")),
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def verbosity() -> int:
  """--verbosity if given, else 0 (absl's default, -1, would also hide our
  info lines)."""
  flag = FLAGS["verbosity"]
  return 0 if flag.using_default_value else flag.value


def run_suites(names, quick: bool, out_path: str) -> dict:
  """Runs the named suites in order; prints each table and rewrites
  `out_path` as each suite ends, so a long run stopped midway keeps the
  suites it finished. Returns the JSON-able results."""
  from dist_loop.runtime import devices  # pylint: disable=g-import-not-at-top
  devices.configure(NUM_DEVICES, "cpu")
  names = list(SUITES) if "all" in names else names
  results = {"machine": machine(), "quick": quick, "suites": {}}
  m = results["machine"]
  print(f"# dist_loop benchmarks ({m['date']}; {m['cpu_count']} cores, "
        f"{m['gpus']} GPUs, TensorFlow {m['tensorflow']})\n", flush=True)
  for name in names:
    t0 = time.time()
    out = importlib.import_module(SUITES[name]).run(quick=quick)
    # Its rows and table, and whatever else it measured (the pipeline's
    # two-core ceiling, the mfu suite's XLA matmuls).
    suite = {**out, "seconds": time.time() - t0}
    results["suites"][name] = suite
    print(f"## {name} ({suite['seconds']:.0f} s)\n\n{suite['table']}\n",
          flush=True)
    atomic_write_json(out_path, results)
  return results


def main(argv):
  del argv
  startup.start(verbosity())  # Imports TensorFlow.
  console.setup(verbosity())
  # Python warnings (Keras fit's, in the overhead suite) are another
  # library's lines too: as log records, the console's filter sees them.
  logging.captureWarnings(True)
  run_suites(FLAGS.suite, FLAGS.quick, FLAGS.out)
  print(f"wrote {FLAGS.out}")
  sys.stdout.flush()
  sys.stderr.flush()
  # Everything is written. Skip interpreter teardown: destroying the many
  # multi-device tf.data iterators that the suites (Keras fit among them)
  # leave behind can block in TensorFlow's destructors for minutes.
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  app.run(main)
