"""Random layers seeded from the step (`dist_loop/training/seeds.py`).

A mask is a function of (seed, step, replica): drawn again from the same
three it repeats, and any of them changed gives another, with and without
XLA. That a resumed run with dropout equals an uninterrupted one is
test_xla.py's.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dist_loop.training import seeds


@pytest.mark.parametrize("jit_compile", [False, True], ids=["plain", "xla"])
def test_a_mask_is_a_function_of_seed_step_and_replica(jit_compile):
  model = keras.Sequential([keras.Input((256,)), keras.layers.Dropout(0.5),
                            keras.layers.Dropout(0.5)])
  states = seeds.generator_states(model)
  assert len(states) == 2  # Both layers', in the model's order.

  # The loop base writes the seeds outside the compiled step.
  @tf.function(jit_compile=jit_compile, autograph=False)
  def masks():
    return [model.layers[0](tf.ones([256]), training=True) > 0,
            model.layers[1](tf.ones([256]), training=True) > 0]

  def drawn(seed, step, replica):
    seeds.reseed(states, seed, tf.constant(step, tf.int64),
                 tf.constant(replica))
    return np.concatenate([m.numpy() for m in masks()])

  keys = [(0, step, replica) for step in (0, 1, 2) for replica in (0, 1)]
  keys.append((1, 0, 0))
  got = {key: drawn(*key) for key in keys}
  assert len({m.tobytes() for m in got.values()}) == len(keys)
  for key in [(0, 1, 0), (1, 0, 0)]:  # Again, after the others.
    np.testing.assert_array_equal(drawn(*key), got[key])
  # The two layers of one step draw different masks.
  first, second = np.split(got[(0, 0, 0)], 2)
  assert (first != second).any()
