"""The terminal: a run prints its own lines; other libraries' on request.

In this process, record by record and line by line; a real command in a
new process prints its own lines only: tests/test_flag_fuzz.py's
`test_a_run_that_trains_does_so_as_a_new_process_with_its_own_lines`.
"""

import logging
import os
import re
import types

import pytest
import tensorflow as tf
from absl import logging as absl_logging

from conftest import REPO
from dist_loop.runtime import console
from experiments import flagfiles

OURS = os.path.join(REPO, "dist_loop", "control", "controller.py")
THEIRS = os.path.join(os.path.dirname(tf.__file__), "python", "checkpoint",
                      "functional_saver.py")


def _record(level, path, name="absl"):
  return logging.LogRecord(name, level, path, 1, "message", None, None)


@pytest.mark.parametrize("verbosity, level, path, shown", [
    (0, logging.INFO, OURS, True),        # Progress, eval, checkpoint lines.
    (0, logging.WARNING, OURS, True),     # A warning to act on.
    (0, logging.INFO, THEIRS, False),     # "Sharding callback duration".
    (0, logging.WARNING, THEIRS, False),
    (0, logging.ERROR, THEIRS, False),    # A lost peer's wall of errors.
    (0, logging.CRITICAL, THEIRS, True),
    (0, logging.ERROR, OURS, True),
    (0, logging.DEBUG, OURS, False),
    (-1, logging.INFO, OURS, False),      # absl's meaning of -1: warnings.
    (-1, logging.WARNING, OURS, True),
    (1, logging.WARNING, THEIRS, True),
    (1, logging.INFO, THEIRS, False),
    (1, logging.ERROR, THEIRS, True),
    (1, logging.DEBUG, OURS, True),
    (2, logging.INFO, THEIRS, True),
])
def test_whose_records_show_at_each_verbosity(verbosity, level, path, shown):
  assert console.QuietFilter(verbosity).filter(_record(level, path)) == shown


def test_the_tensorflow_logger_is_never_ours():
  record = _record(logging.INFO, OURS, name="tensorflow")
  assert not console.QuietFilter(0).filter(record)


@pytest.fixture(name="user_file")
def _user_file(tmp_path):
  """A user's module, outside the repository and every library."""
  path = tmp_path / "my_research" / "model.py"
  path.parent.mkdir()
  path.write_text("")
  return str(path)


@pytest.mark.parametrize("logger, level, shown", [
    ("absl", logging.INFO, True),       # absl.logging.info in the user's file.
    ("absl", logging.WARNING, True),
    ("root", logging.INFO, True),       # logging.info.
    ("my_research.model", logging.INFO, True),  # logging.getLogger(__name__).
    ("my_research.model", logging.DEBUG, False),
    ("tensorflow", logging.WARNING, False),     # By name, wherever it is.
    ("keras", logging.WARNING, False),
    ("keras.src.saving", logging.ERROR, False),
    ("tensorboard", logging.WARNING, False),
    ("py.warnings", logging.WARNING, False),    # Captured Python warnings.
])
def test_a_users_module_logs_like_the_library(user_file, logger, level,
                                              shown):
  """At the default verbosity, whatever directory it is in; the
  libraries by their loggers' names."""
  record = _record(level, user_file, name=logger)
  assert console.QuietFilter(0).filter(record) == shown
  assert console.QuietFilter(1).filter(record)  # Everything at 1 but debug.


def test_a_real_absl_record_of_a_users_module_passes(user_file):
  """Logged through absl from a function of the user's file: the record
  as absl makes it (its logger, its file) passes the console's filter at
  the default verbosity."""
  with open(user_file, "w", encoding="utf-8") as f:
    f.write("from absl import logging\n"
            "def say():\n  logging.info('hello from my model')\n")
  namespace = {}
  with open(user_file, encoding="utf-8") as f:
    exec(compile(f.read(), user_file, "exec"), namespace)  # pylint: disable=exec-used
  records = []
  catch = logging.Handler()
  catch.emit = records.append
  absl_logger = logging.getLogger("absl")
  absl_logger.addHandler(catch)
  absl_level = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.INFO)
  try:
    namespace["say"]()
  finally:
    absl_logging.set_verbosity(absl_level)
    absl_logger.removeHandler(catch)
  (record,) = records
  assert (record.name, record.pathname) == ("absl", user_file)
  assert console.QuietFilter(0).filter(record)


@pytest.mark.parametrize("line, verbosity, kept", [
    ("WARNING: All log messages before absl::InitializeLog() is called are "
     "written to STDERR\n", 0, False),
    ("I0000 00:00:1796.5   32006 port.cc:153] oneDNN custom operations are "
     "on.\n", 0, False),
    ("I0000 00:00:1796.5   32006 port.cc:153] oneDNN custom operations are "
     "on.\n", 2, True),
    ("W0000 00:00:1796.5   32006 cuda.cc:1] no GPU\n", 0, False),
    ("W0000 00:00:1796.5   32006 cuda.cc:1] no GPU\n", 1, True),
    ("E0000 00:00:1796.5   32006 file.cc:1] broken\n", 0, False),
    ("E0000 00:00:1796.5   32006 file.cc:1] broken\n", 1, True),
    ("F0000 00:00:1796.5   32006 file.cc:1] Check failed\n", 0, True),
    ("/x/y.py:3: UserWarning: Python's own warning\n", 0, True),
])
def test_native_start_up_lines(line, verbosity, kept):
  assert console.keep_native_line(line, verbosity) == kept


def test_native_stderr_is_filtered_inside_the_block(capfd):
  for verbosity in (0, 1):
    with console.native_stderr_filtered(verbosity):
      os.write(2, b"I0000 00:00:1.0 1 port.cc:153] oneDNN notice\n"
                  b"E0000 00:00:1.0 1 file.cc:1] a real error\n"
                  b"a line of Python's own\n")
  assert capfd.readouterr().err == (
      "a line of Python's own\n"
      "E0000 00:00:1.0 1 file.cc:1] a real error\na line of Python's own\n")


@pytest.mark.parametrize("verbosity, environment, level", [
    (0, None, "3"), (0, "2", "3"), (0, "0", "3"), (-1, None, "3"),
    (1, "3", "1"), (2, "2", "0"), (3, None, "0")])
def test_the_native_log_level(monkeypatch, verbosity, environment, level):
  """--verbosity's, whatever the environment had: native errors (a lost
  peer's, oneDNN's float16 notice) only from --verbosity=1."""
  if environment is None:
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
  else:
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", environment)
  console.start(verbosity)  # TensorFlow is imported already: env only.
  assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == level


@pytest.mark.parametrize("argv, expected", [
    (["train"], 0),
    (["train", "--mode=async", "--verbosity=2"], 2),
    (["train", "-v=1", "--workdir=x"], 1),
    (["train", "--verbosity=-1"], -1),
    (["train", "--flagfile=/no/such/file", "--verbosity=2"], 0),
])
def test_the_verbosity_is_read_before_tensorflow_starts(argv, expected):
  assert flagfiles.requested_verbosity(argv) == expected


def test_the_verbosity_in_a_flagfile(tmp_path):
  flagfile = tmp_path / "run.flags"
  flagfile.write_text("--mode=sync\n--verbosity=1\n")
  assert flagfiles.requested_verbosity(
      ["train", f"--flagfile={flagfile}"]) == 1


@pytest.fixture
def restored_logging():
  handler = absl_logging.get_absl_handler()
  tf_logger = logging.getLogger("tensorflow")
  saved = (list(handler.filters), handler.python_handler.formatter,
           list(tf_logger.handlers), tf_logger.level)
  yield handler
  handler.filters[:] = saved[0]
  handler.setFormatter(saved[1])
  tf_logger.handlers[:] = saved[2]
  tf_logger.setLevel(saved[3])


def test_setup_replaces_its_filter_and_quiets_tensorflow(restored_logging):
  handler = restored_logging
  tf_logger = logging.getLogger("tensorflow")
  tf_logger.addHandler(logging.StreamHandler())  # As TensorFlow adds one.
  console.setup(0)
  console.setup(1)
  (quiet,) = [f for f in handler.filters
              if isinstance(f, console.QuietFilter)]
  assert quiet.verbosity == 1
  assert tf_logger.level == logging.WARNING and not tf_logger.handlers
  record = _record(logging.WARNING, OURS)
  record.created = 0.0
  assert re.match(r"^\d\d:\d\d:\d\d warning: message$",
                  handler.python_handler.formatter.format(record))


def test_the_banner_names_mode_devices_model_and_data():
  config = types.SimpleNamespace(mode="sync", model="mlp", dataset="digits",
                                 train_steps=600, global_batch_size=64)
  model = types.SimpleNamespace(trainable_variables=[
      tf.Variable(tf.zeros((64, 32))), tf.Variable(tf.zeros((32,)))])
  data = types.SimpleNamespace(train_y=[0] * 1438, eval_y=[0] * 359)
  assert console.banner(
      config, ["/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:1"],
      model, data) == (
          "sync on 2 devices (CPU:0, CPU:1)  |  mlp: 2,080 parameters  |  "
          "digits: 1,438 train / 359 eval examples  |  600 steps of 64")
