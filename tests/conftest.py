"""Test set-up: one process, four logical CPU devices, small everything.

TensorFlow fixes the device list when it starts, so it is set here, before
any test touches TensorFlow; runs on fewer devices use the first N.

Every test is bounded by pytest-timeout (the `timeout` in pyproject.toml, or
a test's `@pytest.mark.timeout(seconds)`): at the bound a test still running
Python fails with its name and its stack, and the run goes on. A test stuck
in native code (a TensorFlow op or destructor) never returns to Python to
see that; for it a backstop, armed below, prints every thread's stack and
ends the process, and pytest-xdist names the test and starts a new worker.
"""

import contextlib
import faulthandler
import gc
import glob
import io
import os
import re
import signal
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

NUM_TEST_DEVICES = 4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A shell's background job (`make test &`) starts with Ctrl-C ignored, and
# the tests that send a real SIGINT (to this process or to the programs it
# starts, which inherit it) would wait for nothing. Behave as a foreground
# run does.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)

# The terminal's stderr, for the backstop: set before pytest captures
# output, so the stacks reach the terminal and not a test's captured text.
_stderr = None


def pytest_configure(config):
  """Fixes the test devices, in every process that runs tests.

  pytest-xdist's controller only hands tests out: it is spared the
  TensorFlow start (10 s of CPU, before it can start the workers).
  """
  global _stderr
  _stderr = os.dup(2)
  if getattr(config.option, "numprocesses", None) and not hasattr(
      config, "workerinput"):
    return
  from experiments import startup  # pylint: disable=g-import-not-at-top
  startup.import_tensorflow()  # As the entry points import it.
  from dist_loop.runtime import devices  # pylint: disable=g-import-not-at-top
  devices.configure(NUM_TEST_DEVICES, "cpu")
  # Tracing makes objects by the million, and each of the collector's full
  # walks also went over every module object TensorFlow and Keras made at
  # import: those are frozen out of its walks, and it walks less often.
  gc.freeze()
  gc.set_threshold(50_000, 20, 100)


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item, settings):
  """The backstop: one more timeout (at most a minute) after the test's own.

  pytest-timeout's own timer (`timeout_method = "signal"`) runs after this.
  """
  del item
  faulthandler.dump_traceback_later(
      settings.timeout + min(60, settings.timeout), exit=True,
      file=_stderr if _stderr is not None else sys.stderr)


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_cancel_timer(item):
  del item
  faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _op_determinism_off_after_each_test():
  """A `--deterministic` run turns op determinism on for its whole process
  (`dist_loop/train.py`); in this shared process the next test must not
  inherit it (it slows some kernels, and `tf.timestamp` fails under it)."""
  yield
  from tensorflow.python.framework import config as tf_config  # pylint: disable=g-import-not-at-top
  if tf_config.is_op_determinism_enabled():
    tf_config.disable_op_determinism()


@pytest.fixture(autouse=True)
def _cluster_read_again_after_each_test():
  """The entry point reads TF_CONFIG once per process and keeps the cluster
  (`experiments.flags.cluster`); a test that parsed flags under its own
  TF_CONFIG (a monkeypatched one, gone after it) must not leave that
  cluster to the next test that parses flags in this process."""
  yield
  run_flags = sys.modules.get("experiments.flags")
  if run_flags is not None:
    run_flags.use_cluster(None)


# The slowest modules, slowest first (`pytest --durations=0`, summed per
# module): `make test` hands whole modules to its two workers in collection
# order (`--dist loadscope --no-loadscope-reorder`), so these go first and
# the run ends on short ones, with both workers busy to the end. A module
# is never split between workers, so its module fixtures are built once.
SLOWEST_MODULES = ("test_ps", "test_multiworker", "test_reliability",
                   "test_entry_point", "test_sharding", "test_flag_fuzz",
                   "test_bench", "test_transformer_modes", "test_pipeline_v2",
                   "test_compression", "test_pipeline", "test_local_sgd")


def pytest_collection_modifyitems(items):
  first = {name: rank for rank, name in enumerate(SLOWEST_MODULES)}
  # Stable: each module's tests, and the other modules, keep their order.
  items.sort(key=lambda item: first.get(item.path.stem, len(first)))


def checkpoint_variables(config):
  """The trainable variables of a run's latest checkpoint, as numpy."""
  from dist_loop.control import weights  # pylint: disable=g-import-not-at-top
  return [np.asarray(v) for v in
          weights.load_model(config).trainable_variables]


def trained_variables(config):
  """Trains `config` in this process, then reads its final variables."""
  from dist_loop import train  # pylint: disable=g-import-not-at-top
  train.run(config)
  return checkpoint_variables(config)


def max_diff(a, b):
  """Largest absolute difference between two lists of arrays."""
  return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def read_events(logdir):
  """What a run wrote to TensorBoard, read from its event files.

  Args:
    logdir: a directory as `tensorboard --logdir` takes it, usually
      WORKDIR/tb (`dist_loop.runtime.summaries.LOGDIR`).

  Returns:
    {name: {step: value}}, named as TensorBoard names them: RUN/TAG, where
    RUN is the event file's directory relative to `logdir` (`train/loss`,
    `eval/loss`, `train/async/staleness_mean`), and just TAG in `logdir`
    itself (`_hparams_/session_start_info`). A scalar reads as a float;
    anything else (histogram, image, the graph of a traced call, the hparams)
    as its `Summary.Value`.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out, plugins = {}, {}
  paths = glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"),
                    recursive=True)
  for path in sorted(paths):
    run = os.path.relpath(os.path.dirname(path), logdir)
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        name = value.tag if run == "." else f"{run}/{value.tag}"
        plugin = value.metadata.plugin_data.plugin_name
        plugin = plugins.setdefault(name, plugin)  # Named at first.
        out.setdefault(name, {})[event.step] = (
            float(tf.make_ndarray(value.tensor)) if plugin == "scalars"
            else value)
  return out


def run_main(*args):
  """`python -m experiments.train ARGS`, in this process.

  What the entry point does before absl parses (flagfiles expanded, the
  user's modules imported and their flags defined; TensorFlow is imported
  already), the real flag parsing (with its parse-time checks) and `main`,
  with the cluster read from this environment as a new process reads it;
  an error before the flags or an absl flag error is printed as the entry
  point or absl's `app.run` prints it. Any other exception propagates, as a
  traceback would.

  Returns:
    (exit code, stdout, stderr); TensorFlow's and absl's logs are not in
    stderr.
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from experiments import flags as run_flags  # pylint: disable=g-import-not-at-top
  from experiments import flagfiles  # pylint: disable=g-import-not-at-top
  from experiments import train as entry  # pylint: disable=g-import-not-at-top
  from dist_loop.core.errors import UserError  # pylint: disable=g-import-not-at-top
  try:
    argv = flagfiles.expand_flagfiles(["train", *args])
    entry.load_user_code(argv)
  except UserError as e:
    return e.exit_code, "", f"error: {e}\n"
  out, err = io.StringIO(), io.StringIO()
  run_flags.use_cluster(None)  # Read this environment, as a new process.
  with flagsaver.flagsaver(), contextlib.redirect_stdout(out), \
      contextlib.redirect_stderr(err):
    flags.FLAGS.unparse_flags()
    try:
      argv = flags.FLAGS(argv)
    except flags.Error as e:
      print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
      code = 1
    except ValueError as e:  # As `entry.parse_flags` says it.
      print(entry.bad_form_line(e), file=sys.stderr)
      code = 2
    else:
      code = entry.main(argv)
  return code, out.getvalue(), err.getvalue()


def run_train(*args, timeout=240):
  """Runs `python -m experiments.train ARGS` in a new process."""
  return subprocess.run(
      [sys.executable, "-m", "experiments.train", *args], cwd=REPO,
      capture_output=True, text=True, timeout=timeout,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


def run_launch(*args, timeout=240):
  """Runs `python -m tools.launch ARGS` (a local cluster) in a new process.

  The launcher's own `--timeout_s` fires first, so it stops its tasks
  before the subprocess timeout could orphan them.
  """
  return subprocess.run(
      [sys.executable, "-m", "tools.launch", f"--timeout_s={timeout - 20}",
       *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


# TensorFlow's, Keras's and absl's lines: Python `tensorflow` logger records
# (and absl's copies, `I1201 12:00:00.1 ...`), native ones (`I0000 ...`,
# `E0000 ...`), the oneDNN notice and absl's pre-initialisation warning.
NOISE = re.compile(r"^(INFO|WARNING):tensorflow:|^[IWEF]\d{4} |oneDNN|"
                   r"absl::InitializeLog", re.MULTILINE)


def run_tool(module, *args, timeout=300):
  """`python -m MODULE ARGS` in a new process, as a user's shell runs it."""
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout,
                        env=env)


@pytest.fixture
def eager_costs(monkeypatch):
  """Pipeline plans from layer costs timed eagerly: the traced measurement
  adds a trace to each pipeline trainer, and only the tests of costs and of
  `auto` (test_pipeline_v2.py) and the flagfiles that ask for it need it.
  Use with `pytestmark = pytest.mark.usefixtures("eager_costs")`."""
  from dist_loop.parallel.modes.pipeline import PipelineTrainer  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(PipelineTrainer, "cost_measurement", "eager")


@pytest.fixture
def small_config(tmp_path):
  """A factory of tiny, fast Configs in a fresh workdir."""
  from dist_loop import make_config  # pylint: disable=g-import-not-at-top

  def make(**overrides):
    base = dict(workdir=str(tmp_path / "run"), dataset="synthetic",
                model="mlp", num_devices=1, global_batch_size=32,
                train_steps=10, optimizer="sgd", learning_rate=0.1,
                steps_per_loop=5, log_every=5, eval_every=10,
                checkpoint_every=10, seed=0)
    base.update(overrides)
    return make_config(**base)

  return make


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
  """A pytest-xdist worker skips the interpreter's teardown.

  By now it has sent its last report. TensorFlow's native teardown takes
  seconds, and the controller waits for every worker to exit.
  """
  if hasattr(config, "workerinput"):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # pylint: disable=protected-access
