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
JSON. A bad `--out` (a directory, a FIFO, a place that cannot be
written) is refused before any suite runs.
`--quick` uses tiny sizes: a smoke run of the harness, not numbers to quote.
Benchmarks are not tests: the test suite asserts no timing.

Ctrl-C or SIGTERM stops the running suite, with the processes it started
(within seconds) and its temporary files, and ends the command with one
line and exit code 130 or 143; `--out` keeps the suites that finished.

The terminal shows the benchmark's own lines only; `--verbosity=1` adds
TensorFlow's warnings, `--verbosity=2` everything
(`dist_loop/runtime/console.py`).
"""

import importlib
import logging
import os
import platform
import signal
import stat
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


@flags.validator("out")
def _writable(path):
  """--out names a file that can be written, checked before any suite runs
  (the first write comes after the first suite)."""
  fix = "name a JSON file, e.g. --out=bench.json"
  if not path or path.endswith(os.sep):
    raise flags.ValidationError(f"not a file name; {fix}")
  try:
    mode = os.stat(path).st_mode
  except (FileNotFoundError, NotADirectoryError):
    mode = None
  except OSError as e:
    raise flags.ValidationError(f"cannot be read ({e.strerror}); {fix}")
  if mode is not None and stat.S_ISDIR(mode):
    raise flags.ValidationError(f"is a directory; {fix}")
  if mode is not None and not stat.S_ISREG(mode):
    raise flags.ValidationError(f"is not a regular file (a FIFO, a socket or "
                                f"a device); {fix}")
  # Its directory, or the nearest that exists: the write creates the rest.
  directory = os.path.dirname(os.path.abspath(path))
  while not os.path.lexists(directory):
    directory = os.path.dirname(directory)
  if not os.path.isdir(directory):
    raise flags.ValidationError(f"{directory} is not a directory; {fix}")
  if not os.access(directory, os.W_OK | os.X_OK):
    raise flags.ValidationError(f"cannot write in {directory} (permission "
                                f"denied); {fix}")
  return True


class Interrupted(KeyboardInterrupt):
  """Ctrl-C or SIGTERM, raised in the main thread so that the running
  suite's cleanup runs (its `finally`s stop what it started)."""


def _interrupted(signum, frame):  # pylint: disable=unused-argument
  # Once: a second signal must not cut the cleanup short, which is bounded.
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
  raise Interrupted(signum)


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


def run_suites(names, quick: bool, out_path: str, finished=None) -> dict:
  """Runs the named suites in order; prints each table and rewrites
  `out_path` as each suite ends, so a long run stopped midway keeps the
  suites it finished (appended to `finished`, if given). Returns the
  JSON-able results."""
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
    if finished is not None:
      finished.append(name)
  return results


def main(argv):
  if len(argv) > 1:
    stray = argv[1:]
    fix = (f"--suite={','.join(stray)}" if all(n in SUITES for n in stray)
           else "--suite=NAME,...")
    print(f"error: unexpected arguments: {' '.join(stray)}; every setting is "
          f"a --flag (suites: {fix})", file=sys.stderr)
    return 1
  finished = []
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, _interrupted)
  try:
    startup.start(verbosity())  # Imports TensorFlow.
    console.setup(verbosity())
    # Python warnings (Keras fit's, in the overhead suite) are another
    # library's lines too: as log records, the console's filter sees them.
    logging.captureWarnings(True)
    run_suites(FLAGS.suite, FLAGS.quick, FLAGS.out, finished)
  except KeyboardInterrupt as e:  # Ctrl-C, or an `Interrupted`.
    signum = e.args[0] if isinstance(e, Interrupted) else signal.SIGINT
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    kept = (f"{FLAGS.out} has the suites that finished: {', '.join(finished)}"
            if finished else f"no suite finished; {FLAGS.out} was not written")
    print(f"error: interrupted ({name}); {kept}", file=sys.stderr)
    _exit(128 + signum)
  print(f"wrote {FLAGS.out}")
  _exit(0)


def _exit(code: int) -> None:
  """Exits once everything is written, skipping interpreter teardown:
  destroying the many multi-device tf.data iterators that the suites (Keras
  fit among them) leave behind can block in TensorFlow's destructors for
  minutes."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


if __name__ == "__main__":
  app.run(main)
