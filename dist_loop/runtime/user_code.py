"""User code is traced with AutoGraph; the library's own code is not.

TensorFlow's guides write a training step with AutoGraph: a Python `if` on a
tensor becomes a `tf.cond`, a `for` over `tf.range` a `tf.while_loop`. A
researcher's mode, compressor, task or delay compensation is written that
way, so the library converts it where it takes it in: a mode's
`replica_step` (`modes/loop.py`), a compressor's `reduce`
(`compression.make`), a task's `sums` (`tasks.for_dataset`), a
compensation (`modes/asynchronous`). What is converted is user code: a
function defined in a module outside `dist_loop` whose class (or the
function itself) does not set `autograph = False`.

The library's own `tf.function`s are traced with `autograph=False`
(`tests/test_start_cost.py`): AutoGraph converts from source at every
process start, which would cost each worker and restart seconds of CPU for
code written without it. The conversion here is at source level
(`tf.autograph.to_graph`), not a nested `tf.function(autograph=True)`, which
inside a replica's step could not `merge_call`. It is recursive, so a user's
helpers are converted too; the library's functions a user's code calls are
not (`DoNotConvert("dist_loop")`, added to AutoGraph's rules on first use),
so a run of the library's own components converts nothing at all.
"""

import inspect
import types
from typing import Callable

import tensorflow as tf

LIBRARY = "dist_loop"


def is_library(obj) -> bool:
  """Whether `obj` (a function, class or method) is defined in dist_loop."""
  module = getattr(getattr(obj, "__func__", obj), "__module__", None) or ""
  return module == LIBRARY or module.startswith(LIBRARY + ".")


def wants_autograph(fn: Callable) -> bool:
  """Whether `fn` is user code that has not opted out: its module is not
  dist_loop's, and neither the function nor the class of the object it is
  bound to sets `autograph = False`."""
  if is_library(fn) or not getattr(fn, "autograph", True):
    return False
  owner = getattr(fn, "__self__", None)
  if owner is not None and not getattr(type(owner), "autograph", True):
    return False
  return True


def convert(fn: Callable) -> Callable:
  """`fn` converted with AutoGraph if it is user code (`wants_autograph`),
  else `fn` itself. A bound method stays bound."""
  if not wants_autograph(fn):
    return fn
  _keep_library_unconverted()
  if inspect.ismethod(fn):  # `to_graph` returns the function, unbound.
    return types.MethodType(
        tf.autograph.to_graph(fn.__func__, recursive=True), fn.__self__)
  return tf.autograph.to_graph(fn, recursive=True)


def convert_method(obj, name: str) -> None:
  """Replaces `obj.name` by its converted form on `obj` (the instance
  only), if it is user code."""
  method = getattr(obj, name)
  converted = convert(method)
  if converted is not method:
    setattr(obj, name, converted)


def _keep_library_unconverted() -> None:
  """Adds `DoNotConvert("dist_loop")` to AutoGraph's rules, once: a user's
  step that calls the step core or an optimizer helper leaves them as they
  are written (with `tf.cond` and `tf.while_loop` where they need them)."""
  from tensorflow.python.autograph.core import config  # pylint: disable=g-import-not-at-top
  rule = config.DoNotConvert(LIBRARY)
  if not any(getattr(r, "_prefix", None) == LIBRARY
             for r in config.CONVERSION_RULES):
    config.CONVERSION_RULES = (rule,) + tuple(config.CONVERSION_RULES)
