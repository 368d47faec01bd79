"""TensorFlow's import, without the plotting library Keras loads for nothing.

Keras imports `matplotlib.pyplot` at its own import whenever matplotlib is
installed, for plotting helpers (`keras.visualization`) that dist_loop never
calls. dist_loop depends on matplotlib (`tools.compare` draws with it), so
every process would pay for pyplot at start-up: `import tensorflow` took
7.7-8.4 s of CPU with it and 6.7-7.1 s without (3 runs each), in every
worker of a cluster and at every restart.

`import_tensorflow()` imports TensorFlow, and so Keras, with matplotlib
out of sight. matplotlib imports normally afterwards (`tools.compare`);
only Keras's own plotting helpers then say that it is not installed. The
entry points call it before anything imports TensorFlow
(`console.start`); a program that imports TensorFlow first simply pays
the second.
"""

import importlib
import importlib.abc
import sys

_HIDDEN = "matplotlib"


class _Hide(importlib.abc.MetaPathFinder):
  """Makes `matplotlib` and its submodules fail to import."""

  def find_spec(self, name, path=None, target=None):
    del path, target
    if name == _HIDDEN or name.startswith(_HIDDEN + "."):
      raise ModuleNotFoundError(f"{name} is hidden while TensorFlow loads",
                                name=name)
    return None


def import_tensorflow():
  """Imports TensorFlow (once) with matplotlib hidden; returns the module."""
  if "tensorflow" in sys.modules or _HIDDEN in sys.modules:
    return importlib.import_module("tensorflow")
  finder = _Hide()
  sys.meta_path.insert(0, finder)
  try:
    return importlib.import_module("tensorflow")
  finally:
    sys.meta_path.remove(finder)
