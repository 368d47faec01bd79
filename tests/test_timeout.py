"""Every test is bounded: pytest run on generated tests that hang, with the
project's pytest settings and a 1 s bound. A hang in Python fails that test
with its name and its stack, and the run goes on, under pytest-xdist as
`make test` runs it; a hang in native code meets conftest's backstop, which
prints every thread's stack and ends the process."""

import os
import subprocess
import sys

from conftest import REPO

SLEEPS = '''
import time


def test_sleeps():
  time.sleep(120)


def test_after():
  pass
'''

BLOCKS = '''
import ctypes


def test_blocks_in_native_code():
  # A default pthread mutex locked twice: no signal handler can end it.
  mutex = ctypes.create_string_buffer(64)
  libc = ctypes.CDLL(None)
  libc.pthread_mutex_lock(mutex)
  libc.pthread_mutex_lock(mutex)
'''


# What conftest.py needs of dist_loop and experiments, without TensorFlow:
# the backstop under test is conftest's own code, and importing TensorFlow
# in the pytest process would be most of this file's time.
DEVICES_STUB = '''
def configure(*args, **kwargs):
  del args, kwargs
'''
TF_IMPORT_STUB = '''
def import_tensorflow():
  pass
'''


def _pytest(directory, source, *args):
  """pytest with the project's settings (timeout method, required plugin)
  and a 1 s bound, on one generated test file; dist_loop and experiments
  are stubs of `devices.configure` and `startup.import_tensorflow`."""
  (directory / "test_hangs.py").write_text(source)
  stub = directory / "stub" / "dist_loop"
  stub.mkdir(parents=True)
  (stub / "__init__.py").write_text("")
  (stub / "devices.py").write_text(DEVICES_STUB)
  (stub.parent / "experiments").mkdir()
  (stub.parent / "experiments" / "__init__.py").write_text("")
  (stub.parent / "experiments" / "startup.py").write_text(TF_IMPORT_STUB)
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-c",
       os.path.join(REPO, "pyproject.toml"), "--rootdir", str(directory),
       "-p", "no:cacheprovider", "-p", "no:randomly", "--timeout=1", "-q",
       *args, str(directory / "test_hangs.py")],
      cwd=directory, capture_output=True, text=True, timeout=180,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([str(stub.parent),
                                         os.path.join(REPO, "tests")])})
  return result.returncode, result.stdout + result.stderr


def test_a_test_hung_in_python_fails_with_its_name_and_stack(tmp_path):
  code, out = _pytest(tmp_path, SLEEPS, "-n", "1")
  assert code == 1, out
  assert "FAILED test_hangs.py::test_sleeps - Failed: Timeout (>1.0s)" in out
  assert "time.sleep(120)" in out  # The line it hung on.
  assert "1 failed, 1 passed" in out  # The run went on.


def test_a_test_hung_in_native_code_ends_with_every_stack(tmp_path):
  # `-p conftest`: the backstop is in tests/conftest.py.
  code, out = _pytest(tmp_path, BLOCKS, "-p", "conftest", "-n", "0")
  assert code == 1, out
  # Python's faulthandler, one more timeout after the test's own.
  assert "Timeout (0:00:02)!" in out
  assert ('test_hangs.py", line 10 in test_blocks_in_native_code') in out
