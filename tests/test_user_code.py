"""User code is traced with AutoGraph (`dist_loop/runtime/user_code.py`).

A mode registered from a module outside the repository writes its step the
way TensorFlow's guides do: a Python `if` on a tensor and a `for` over
`tf.range`. It must train on 1 and on 2 replicas, equal the same step
written with `tf.cond` and `tf.while_loop`, and leave the library's own
code unconverted.
"""

import importlib.util
import os
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.autograph.impl import api as autograph_api

from conftest import REPO
from dist_loop.parallel.compression import COMPRESSORS
from dist_loop.parallel.modes import MODES
from dist_loop.runtime import user_code
from helpers import initial_and_trained

# One module, two modes: `guide` with AutoGraph's Python control flow, and
# `written_out` with the same ops spelled as tf.cond / tf.while_loop (and
# `autograph = False`, so it shows the opt-out too).
USER_MODULE = '''
import tensorflow as tf

from dist_loop import models
from dist_loop.training import optim
from dist_loop.training import step as step_core
from dist_loop.parallel.compression import COMPRESSORS, Compressor, nbytes
from dist_loop.parallel.modes import MODES, LoopTrainer, StepResult
from dist_loop.parallel.modes.mirrored import Mirrored

CLIP = 0.05  # Small: clipping happens in some steps, not all.
TERMS = 3


class _Base(Mirrored, LoopTrainer):

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    self.strategy = self.build_strategy()
    self.contributors = self.strategy.num_replicas_in_sync
    with self.strategy.scope():
      self.model = models.build_for(config, dataset)
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables)
      self.step = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="step",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

  def _reduced(self, batch):
    x, y = batch
    shares, grads = step_core.gradients(
        self.task, self.model, x, y,
        examples_per_update=self.examples_per_step,
        contributors=self.contributors)
    context = tf.distribute.get_replica_context()
    grads = context.all_reduce(tf.distribute.ReduceOp.SUM,
                               [tf.convert_to_tensor(g) for g in grads])
    return shares, grads

  def _apply(self, shares, grads):
    ok = optim.all_finite(grads)
    optim.apply_reduced(self.optimizer, grads,
                        self.model.trainable_variables, ok)
    return StepResult(shares, ok, {"grad_norm": tf.linalg.global_norm(grads)})


@MODES.register("guide")
class Guide(_Base):
  """Clips the gradient's norm with `if`, damps it with a `for`."""

  def replica_step(self, batch, variant):
    shares, grads = self._reduced(batch)
    norm = tf.linalg.global_norm(grads)
    if norm > CLIP:
      grads = [g * (CLIP / norm) for g in grads]
    factor = tf.constant(0.0)
    for i in tf.range(TERMS):
      factor += 1.0 / tf.cast(i + 1, tf.float32)
    return self._apply(shares, [g / factor for g in grads])


@MODES.register("written_out")
class WrittenOut(_Base):
  """The same step with the control flow written out."""

  autograph = False

  def replica_step(self, batch, variant):
    shares, grads = self._reduced(batch)
    norm = tf.linalg.global_norm(grads)
    grads = tf.cond(norm > CLIP, lambda: [g * (CLIP / norm) for g in grads],
                    lambda: list(grads))
    _, factor = tf.while_loop(
        lambda i, f: i < TERMS,
        lambda i, f: (i + 1, f + 1.0 / tf.cast(i + 1, tf.float32)),
        (tf.constant(0), tf.constant(0.0)))
    return self._apply(shares, [g / factor for g in grads])


@COMPRESSORS.register("guarded")
class Guarded(Compressor):
  """The exact sum, with a gradient that holds a NaN sent as zeros."""

  def reduce(self, grads, state, step):
    out = []
    for g in self.all_reduce(grads):
      if tf.reduce_any(tf.math.is_nan(g)):
        g = tf.zeros_like(g)
      out.append(g)
    return out, state

  def wire_bytes(self):
    return sum(nbytes(s, d) for s, d in zip(self.shapes, self.dtypes))
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
  """The user's module, imported from a directory outside the repository."""
  path = tmp_path_factory.mktemp("user") / "my_modes.py"
  path.write_text(USER_MODULE)
  assert not os.path.realpath(path).startswith(REPO)
  spec = importlib.util.spec_from_file_location("my_modes", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules["my_modes"] = module
  spec.loader.exec_module(module)
  yield module
  for name in ("guide", "written_out"):  # Other tests list them.
    MODES._entries.pop(name)  # pylint: disable=protected-access
  COMPRESSORS._entries.pop("guarded")  # pylint: disable=protected-access
  sys.modules.pop("my_modes", None)


def _trained(small_config, mode, devices):
  config = small_config(mode=mode, num_devices=devices, train_steps=4,
                        steps_per_loop=4, global_batch_size=16)
  return initial_and_trained(config, 4)


def test_a_user_step_with_python_control_flow_on_tensors_trains(
    user_module, small_config):
  del user_module
  start, guide_one = _trained(small_config, "guide", 1)
  _, written_one = _trained(small_config, "written_out", 1)
  _, guide_two = _trained(small_config, "guide", 2)
  _, written_two = _trained(small_config, "written_out", 2)
  assert any(not np.array_equal(a, b) for a, b in zip(start, guide_one))
  for a, b in zip(guide_one, written_one):  # The same ops: the same bits.
    np.testing.assert_array_equal(a, b)
  for a, b in zip(guide_two, written_two):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(guide_one, guide_two):  # 2 replicas = 1 replica.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  converted = {c.co_filename for c in
               autograph_api._TRANSPILER._cache._cache  # pylint: disable=protected-access
               if hasattr(c, "co_filename")}
  assert any(name.endswith("my_modes.py") for name in converted)
  library = os.path.join(REPO, "dist_loop") + os.sep
  assert not [name for name in converted
              if os.path.realpath(name).startswith(library)]


def test_a_user_compressor_with_a_tensor_if_equals_the_exact_sum(
    user_module, small_config):
  del user_module
  trained = {
      name: initial_and_trained(small_config(
          mode="sync", num_devices=2, train_steps=3, steps_per_loop=3,
          global_batch_size=16, allreduce_compression=name), 3)[1]
      for name in ("guarded", "none")}
  for a, b in zip(trained["guarded"], trained["none"]):
    np.testing.assert_array_equal(a, b)


def test_what_is_user_code(user_module):
  assert user_code.wants_autograph(user_module.Guide.replica_step)
  assert user_code.is_library(user_module.Guide.build_strategy)
  assert not user_code.wants_autograph(user_module.Guide.train)

  class Bound:
    autograph = False

    def method(self):
      return 1

  assert not user_code.wants_autograph(Bound().method)
  bound = Bound()
  user_code.convert_method(bound, "method")
  assert "method" not in vars(bound)  # Opted out: left as it was.


def test_conversion_turns_a_tensor_if_into_a_cond():
  def clip(x):
    if x > 1.0:
      x = tf.constant(1.0)
    return x

  converted = user_code.convert(clip)
  graph = tf.function(converted, autograph=False)
  assert float(graph(tf.constant(3.0))) == 1.0
  assert float(graph(tf.constant(0.5))) == 0.5
  with pytest.raises(TypeError):  # Unconverted, a traced `if` fails.
    tf.function(clip, autograph=False)(tf.constant(3.0))
