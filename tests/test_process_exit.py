"""An entry point's exit skips the collector's walks, and only that.

`startup.skip_final_gc` (experiments/startup.py) must leave garbage cycles uncollected at exit
(that walk over every traced graph is the cost it saves) while atexit
handlers still run. Checked in a bare Python process, without TensorFlow.
"""

import subprocess
import sys

from conftest import REPO

SCRIPT = """
import atexit, importlib.util, sys
spec = importlib.util.spec_from_file_location(
    "startup", "experiments/startup.py")
startup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(startup)

class Cycle:
  def __del__(self):
    sys.stdout.write("collected\\n")

if sys.argv[1] == "skip":
  startup.skip_final_gc()
atexit.register(lambda: sys.stdout.write("atexit ran\\n"))
a, b = Cycle(), Cycle()
a.other, b.other = b, a  # A cycle: only the collector frees it.
del a, b
"""


def _exit_lines(mode):
  result = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          check=True)
  return result.stdout.splitlines()


def test_the_final_collection_is_skipped_and_atexit_handlers_still_run():
  assert _exit_lines("normal") == ["atexit ran", "collected", "collected"]
  assert _exit_lines("skip") == ["atexit ran"]
