"""What every process pays before it trains, kept from growing back.

Two costs were paid at every start of every process (each worker of a
cluster, each restart) and are gone; these tests fail if they return:
- AutoGraph: every `tf.function` of the repository (the library, the
  tools, these tests) is traced with `autograph=False` (why:
  `modes/loop.py`, "No AutoGraph"; a test's `tf.function` around library
  code would convert that code too). Read from the source with `ast`, so a
  new `tf.function` is caught before it runs; and a whole run checks what
  the source does not show: tf.data's functions, and those TensorFlow
  wraps in a `tf.function` of its own.
- matplotlib at TensorFlow's import (`dist_loop/runtime/tf_import.py`): conftest
  imports TensorFlow the way the entry points do.
"""

import ast
import importlib
import os
import sys

import pytest
from tensorflow.python.autograph.impl import api as autograph_api

from conftest import REPO
from dist_loop import train
from dist_loop.runtime import tf_import

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
                         "(modes/loop.py, 'No AutoGraph'):\n"
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


def test_a_run_converts_none_of_the_repository_with_autograph(small_config):
  """AutoGraph keeps every function it converted, by code object, for the
  life of the process (its transpiler's cache: TensorFlow internals, read
  only here). After a run with replicas, accumulation, evaluation and a
  checkpoint (and whatever this process ran before it), none of the
  repository's code may be among them."""
  summary = train.run(small_config(num_devices=2, grad_accum_steps=3,
                                   global_batch_size=24, train_steps=2,
                                   steps_per_loop=2, eval_every=2,
                                   checkpoint_every=2))
  assert summary["final_step"] == 2
  converted = list(autograph_api._TRANSPILER._cache._cache)  # pylint: disable=protected-access
  ours = sorted({f"{os.path.relpath(c.co_filename, REPO)}:{c.co_name}"
                 for c in converted if hasattr(c, "co_filename")
                 and os.path.realpath(c.co_filename).startswith(REPO)})
  assert not ours, ours


def test_tensorflow_loads_without_matplotlib_which_still_imports_after():
  keras_gallery = sys.modules["keras.src.visualization.plot_image_gallery"]
  # Keras looked for pyplot while conftest imported TensorFlow, and did not
  # find it; nothing of the hiding is left behind.
  assert keras_gallery.plt is None
  assert not [f for f in sys.meta_path if isinstance(f, tf_import._Hide)]  # pylint: disable=protected-access
  pyplot = importlib.import_module("matplotlib.pyplot")
  assert callable(pyplot.subplots)
  assert tf_import.import_tensorflow() is sys.modules["tensorflow"]


def test_the_hiding_covers_matplotlib_and_its_submodules_only():
  finder = tf_import._Hide()  # pylint: disable=protected-access
  for name in ("matplotlib", "matplotlib.pyplot"):
    with pytest.raises(ModuleNotFoundError, match="hidden"):
      finder.find_spec(name)
  for name in ("matplotlibx", "numpy", "keras.src.visualization"):
    assert finder.find_spec(name) is None
