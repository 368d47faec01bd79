"""What every process pays before it trains, kept from growing back.

Two costs were paid at every start of every process (each worker of a
cluster, each restart) and are gone; these tests fail if they return:
- AutoGraph on the library's code: every `tf.function` of the repository
  (the library, the tools, these tests) is traced with `autograph=False`
  (why: `dist_loop/runtime/user_code.py`; a test's `tf.function` around library
  code would convert that code too). Read from the source with `ast`, so a
  new `tf.function` is caught before it runs; and a whole run checks what
  the source does not show: tf.data's functions, and those TensorFlow
  wraps in a `tf.function` of its own. User code is converted on purpose
  (`user_code.convert`); `tests/test_user_code.py` checks that a user's
  mode converts its own code and none of the library's.
- matplotlib at TensorFlow's import (`experiments/startup.py`): conftest
  imports TensorFlow the way the entry points do. Keras's plotting helpers
  still work.
"""

import ast
import importlib
import importlib.util
import os
import sys

from tensorflow.python.autograph.impl import api as autograph_api

from conftest import REPO
from dist_loop import train
from experiments import startup

TRACED_DIRS = ("dist_loop", "experiments", "tools", "tests")


def _sources():
  for top in TRACED_DIRS:
    for directory, _, files in os.walk(os.path.join(REPO, top)):
      for name in sorted(files):
        if name.endswith(".py"):
          yield os.path.join(directory, name)


def _is_tf_function(node) -> bool:
  return (isinstance(node, ast.Attribute) and node.attr == "function"
          and isinstance(node.value, ast.Name) and node.value.id == "tf")


def _autograph_on(path):
  """(line, text) of each `tf.function` in `path` that converts."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      found += [(d.lineno, "@tf.function") for d in node.decorator_list
                if _is_tf_function(d)]  # A bare decorator: AutoGraph on.
    if isinstance(node, ast.Call) and _is_tf_function(node.func):
      off = any(k.arg == "autograph" and isinstance(k.value, ast.Constant)
                and k.value.value is False for k in node.keywords)
      if not off:
        found.append((node.lineno, ast.unparse(node)[:80]))
  return found


def test_every_tf_function_of_the_library_is_traced_without_autograph():
  offenders = [f"{os.path.relpath(path, REPO)}:{line}: {text}"
               for path in _sources() for line, text in _autograph_on(path)]
  assert not offenders, ("tf.function without autograph=False "
                         "(dist_loop/runtime/user_code.py says why):\n"
                         + "\n".join(offenders))


def test_the_check_sees_each_way_of_leaving_autograph_on(tmp_path):
  """The source check above, on code that leaves AutoGraph on in each
  form it takes, and on code that turns it off."""
  path = tmp_path / "m.py"
  path.write_text(
      "import tensorflow as tf\n"
      "@tf.function\n"
      "def a(): pass\n"
      "b = tf.function(a)\n"
      "c = tf.function(a, autograph=True)\n"
      "@tf.function(jit_compile=True)\n"
      "def d(): pass\n"
      "e = tf.function(a, autograph=False)\n"
      "@tf.function(autograph=False)\n"
      "def f(): pass\n")
  assert [line for line, _ in _autograph_on(path)] == [2, 4, 5, 6]


def test_a_run_converts_none_of_the_library_with_autograph(small_config):
  """AutoGraph keeps every function it converted, by code object, for the
  life of the process (its transpiler's cache: TensorFlow internals, read
  only here). After a run with replicas, accumulation, evaluation and a
  checkpoint (and whatever this process ran before it), none of the
  library's or the tools' code may be among them. The worked examples and
  tests may be: they are user code (`user_code.convert`)."""
  summary = train.run(small_config(num_devices=2, grad_accum_steps=3,
                                   global_batch_size=24, train_steps=2,
                                   steps_per_loop=2, eval_every=2,
                                   checkpoint_every=2))
  assert summary["final_step"] == 2
  converted = list(autograph_api._TRANSPILER._cache._cache)  # pylint: disable=protected-access
  library = tuple(os.path.join(REPO, top) + os.sep
                  for top in ("dist_loop", "tools"))
  ours = sorted({f"{os.path.relpath(c.co_filename, REPO)}:{c.co_name}"
                 for c in converted if hasattr(c, "co_filename")
                 and os.path.realpath(c.co_filename).startswith(library)})
  assert not ours, ours


def test_tensorflow_loads_without_pyplot_and_keras_can_still_plot(tmp_path):
  """conftest imported TensorFlow as the entry points do: Keras got a
  stand-in for pyplot, not pyplot. Afterwards the real pyplot imports,
  the stand-in reads through to it, and Keras's plotting helper draws."""
  keras_gallery = sys.modules["keras.src.visualization.plot_image_gallery"]
  assert isinstance(keras_gallery.plt, startup._Deferred)  # pylint: disable=protected-access
  assert not [f for f in sys.meta_path if isinstance(f, startup._Finder)]  # pylint: disable=protected-access
  pyplot = importlib.import_module("matplotlib.pyplot")
  assert not isinstance(pyplot, startup._Deferred)  # pylint: disable=protected-access
  assert keras_gallery.plt.subplots is pyplot.subplots
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  keras.visualization.plot_image_gallery(
      np.zeros((2, 8, 8, 3)), value_range=(0, 1), path=str(tmp_path / "g.png"))
  assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert startup.import_tensorflow() is sys.modules["tensorflow"]


def test_the_deferral_covers_matplotlib_modules_that_exist_only():
  real = importlib.util.find_spec("matplotlib").submodule_search_locations
  finder = startup._Finder(real)  # pylint: disable=protected-access
  for name in ("matplotlib", "matplotlib.pyplot", "matplotlib.patches"):
    assert finder.find_spec(name).loader is finder
  for name in ("matplotlibx", "numpy", "keras.src.visualization",
               "matplotlib.no_such_module"):
    assert finder.find_spec(name) is None
