"""An entry point's process: a quiet, cheaper start and a cheaper exit.

What the entry points (`experiments.train`, `tools.bench`,
`tools.compare`) do to their own process, and a library must not do to a
user's: `start(verbosity)`, before anything imports TensorFlow.

* **matplotlib deferred while TensorFlow imports.** Keras imports
  `matplotlib.pyplot` at its own import whenever matplotlib is installed,
  for plotting helpers (`keras.visualization`) a run never calls; pyplot
  costs about a second of CPU in every process (each worker of a cluster,
  each restart). While TensorFlow imports, `matplotlib` and its submodules
  import as empty stand-ins (`_Deferred`); afterwards the stand-ins leave
  `sys.modules`, so the next `import matplotlib.pyplot` is the real one,
  and each stand-in Keras kept loads the real module at its first use, so
  Keras's plotting helpers work. Nothing is deferred if matplotlib is not
  installed: Keras then reports it missing, as it would.
* **The exit without the collector's last walks** (`skip_final_gc`). When
  Python shuts down it clears every module and runs the cyclic garbage
  collector again and again over what is left: after a run, every traced
  graph and Keras object, about 2 s of CPU for a small model, freeing
  memory the operating system takes back anyway. Frozen objects
  (`gc.freeze`) are never walked, so freezing them at exit leaves the rest
  of the shutdown as it was: atexit handlers, file flushes and destructors
  still run.

`tests/test_start_cost.py` keeps both costs out.
"""

import atexit
import contextlib
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_DEFERRED = "matplotlib"


def start(verbosity: int) -> None:
  """An entry point's first step: the exit without the collector, then
  TensorFlow imported quietly (`console.start`) with matplotlib deferred."""
  from dist_loop.runtime import console  # pylint: disable=g-import-not-at-top
  skip_final_gc()
  with matplotlib_deferred():
    console.start(verbosity)


def import_tensorflow():
  """TensorFlow, imported with matplotlib deferred (as `start` imports it,
  without the console's filtering); returns the module."""
  with matplotlib_deferred():
    return importlib.import_module("tensorflow")


def skip_final_gc() -> None:
  """Freezes every object once the interpreter starts to exit (called
  early, so the freeze runs after the atexit handlers registered later)."""
  atexit.register(gc.freeze)


class _Deferred(types.ModuleType):
  """A stand-in for a matplotlib module: empty while the deferral lasts;
  after it, any attribute read loads the real module and reads it there."""

  active = False

  def __getattr__(self, name):
    if _Deferred.active:
      raise AttributeError(name)
    return getattr(importlib.import_module(self.__name__), name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Serves `_Deferred` stand-ins for matplotlib's modules that exist."""

  def __init__(self, locations):
    self.locations = locations  # Where the real package's modules are.

  def find_spec(self, name, path=None, target=None):
    del path, target
    if name != _DEFERRED and not name.startswith(_DEFERRED + "."):
      return None
    if name != _DEFERRED and importlib.machinery.PathFinder.find_spec(
        name, self.locations) is None:
      return None  # No such module: it fails to import, as it would.
    return importlib.util.spec_from_loader(
        name, self, is_package=name == _DEFERRED)

  def create_module(self, spec):
    module = _Deferred(spec.name)
    if spec.name == _DEFERRED:
      module.__path__ = list(self.locations)
    return module

  def exec_module(self, module):
    pass


@contextlib.contextmanager
def matplotlib_deferred():
  """Inside the block, matplotlib's modules import as `_Deferred`
  stand-ins; after it, as themselves."""
  spec = None if _DEFERRED in sys.modules else importlib.util.find_spec(
      _DEFERRED)
  if spec is None or not spec.submodule_search_locations:
    yield  # Imported already, or not installed.
    return
  finder = _Finder(spec.submodule_search_locations)
  sys.meta_path.insert(0, finder)
  _Deferred.active = True
  try:
    yield
  finally:
    _Deferred.active = False
    sys.meta_path.remove(finder)
    for name in [n for n, m in sys.modules.items()
                 if isinstance(m, _Deferred)]:
      del sys.modules[name]
