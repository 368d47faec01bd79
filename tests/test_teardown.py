"""Closing a trainer is bounded and frees its input.

Freeing a tf.data iterator that tf.data autotunes cancels its optimisation
thread and waits for it, and that thread can miss the wake-up and sleep out
its round, up to a minute (`data/stream.py`, `without_autotune`): a
benchmark that closed 16 trainers hung for over ten minutes. So every
iterator a trainer opens must run without autotuning, and `close` must free
them.
"""

import gc
import weakref

import keras
import pytest
import tensorflow as tf

from helpers import load_data
from dist_loop import configure, make_config
from dist_loop.parallel.modes import build_trainer
from dist_loop.runtime import devices
from dist_loop.runtime.cluster import Cluster


@pytest.fixture
def opened(monkeypatch):
  """Every tf.data iterator opened meanwhile: (autotune option, weakref)."""
  iterators = []
  original = tf.data.Dataset.__iter__

  def spy(self):
    iterator = original(self)
    iterators.append((self.options().autotune.enabled,
                      weakref.ref(iterator)))
    return iterator

  monkeypatch.setattr(tf.data.Dataset, "__iter__", spy)
  return iterators


@pytest.mark.parametrize("flags", [
    dict(mode="sync", num_devices=2),  # Two replicas fed from one host.
    dict(mode="async", num_devices=2),  # Two workers, one input each.
])
def test_a_trainers_input_is_not_autotuned_and_close_frees_it(
    tmp_path, opened, flags):
  config = configure.validate(make_config(
      workdir=str(tmp_path), dataset="synthetic", model="mlp",
      global_batch_size=8, train_steps=2, seed=0, **flags), Cluster())
  keras.utils.set_random_seed(0)
  trainer = build_trainer(config, devices.configure(config.num_devices,
                                                    "cpu"),
                          load_data(config), Cluster())
  trainer.train(2)
  assert opened
  assert [autotuned for autotuned, _ in opened] == [False] * len(opened)
  trainer.close()
  gc.collect()  # The trainer lives on: `close` itself let go of the input.
  assert [alive() for _, alive in opened] == [None] * len(opened)
