"""Building a trainer in the test process, reading its variables and what
its traced step hands to the collectives.

Tests of one mode compare its variables with another's, so they share these
instead of importing them from each other's test files. `conftest.py` holds
the fixtures and the helpers that run whole programs (`run_main`,
`read_events`); this module holds what works on one trainer.
"""

import contextlib
import sys
import threading
from unittest import mock

import keras
import numpy as np
import tensorflow as tf

from dist_loop import configure, data, models
from dist_loop.data.base import DATASETS, Dataset
from dist_loop.parallel.modes import build_trainer
from dist_loop.runtime import devices
from dist_loop.runtime.cluster import Cluster

NAN_DATASET = "test_nan"  # Every example is NaN: every step is non-finite.


@DATASETS.register(NAN_DATASET)
def _nan_dataset(data_dir, seed, image_size=None):
  del data_dir, seed, image_size
  x = np.full((64, 10), np.nan, np.float32)
  y = np.zeros(64, np.int32)
  return Dataset(x, y, x[:8], y[:8], 10)


def load_data(config):
  """The config's dataset as `train.run` loads it: images at the size the
  model wants."""
  return data.load(config, models.image_size_for(config.model))


def make_trainer(config):
  """The config's trainer, built in this process as `train.run` builds it,
  without the controller (no evaluation, checkpoints or summaries)."""
  config = configure.validate(config, Cluster())
  keras.utils.set_random_seed(config.seed)
  return build_trainer(config, devices.configure(config.num_devices, "cpu"),
                       load_data(config), Cluster())


def variables(trainer):
  """The trainer's trainable variables, as numpy (a mirrored variable reads
  as the first replica's copy)."""
  return [np.asarray(v) for v in trainer.model.trainable_variables]


def initial_and_trained(config, steps):
  """(initial, trained) variables of `steps` steps of `config`'s trainer."""
  trainer = make_trainer(config)
  start = variables(trainer)
  trainer.train(steps)
  end = variables(trainer)
  trainer.close()
  return start, end


def replica_copies(trainer):
  """Every replica's copy of every trainable variable."""
  return [[t.numpy() for t in
           trainer.strategy.experimental_local_results(v.value)]
          for v in trainer.model.trainable_variables]


@contextlib.contextmanager
def kept_registrations(*registries):
  """Leaves this process's components (those of `configure.COMPONENTS` and
  `registries`), flags, modules and sys.path as they were: a user's module
  registers for the whole process."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from experiments import flags as run_flags  # pylint: disable=g-import-not-at-top
  registries = [r for _, r, _ in configure.COMPONENTS] + list(registries)
  saved = ([dict(r._entries) for r in registries],  # pylint: disable=protected-access
           set(flags.FLAGS), dict(run_flags._OPTION_FLAGS),  # pylint: disable=protected-access
           set(sys.modules), list(sys.path))
  try:
    yield
  finally:
    for registry, entries in zip(registries, saved[0]):
      registry._entries.clear()  # pylint: disable=protected-access
      registry._entries.update(entries)  # pylint: disable=protected-access
    for name in set(flags.FLAGS) - saved[1]:
      delattr(flags.FLAGS, name)
    run_flags._OPTION_FLAGS.clear()  # pylint: disable=protected-access
    run_flags._OPTION_FLAGS.update(saved[2])  # pylint: disable=protected-access
    for name in set(sys.modules) - saved[3]:
      del sys.modules[name]
    sys.path[:] = saved[4]


def step_graph(trainer, examples=32):
  """The graph of one traced sync step of `trainer` (`replica_step` of the
  compressor's variant under its strategy), nothing run."""
  x = tf.constant(trainer.dataset.train_x[:examples])
  y = tf.constant(trainer.dataset.train_y[:examples])

  @tf.function(autograph=False)
  def step(x, y):
    return trainer.strategy.run(
        lambda x, y: trainer.replica_step((x, y), None).shares, args=(x, y))

  return step.get_concrete_function(x, y).graph


def handed_bytes(trainer):
  """([(collective, bytes)], graph): in call order, what replica 0 hands to
  `ReplicaContext.all_reduce` and `all_gather` in one traced step, and
  that step's graph (`step_graph`). The bytes are the static shapes and
  dtypes of the tensors the step sends, counted where they enter the
  collectives, not by a formula."""
  calls = []
  inside = threading.local()  # Each replica runs in a thread of its own.

  def counting(name, value_of):
    original = getattr(tf.distribute.ReplicaContext, name)

    def wrapper(self, *args, **kwargs):
      depth = getattr(inside, "depth", 0)
      if depth == 0 and tf.get_static_value(
          self.replica_id_in_sync_group) == 0:
        calls.append((name, sum(
            t.shape.num_elements() * t.dtype.size
            for t in tf.nest.flatten(value_of(*args, **kwargs)))))
      inside.depth = depth + 1
      try:
        return original(self, *args, **kwargs)
      finally:
        inside.depth = depth

    return mock.patch.object(tf.distribute.ReplicaContext, name, wrapper)

  with counting("all_reduce", lambda op, value, options=None: value), \
      counting("all_gather", lambda value, axis, options=None: value):
    graph = step_graph(trainer)
  return calls, graph


def record_host_timing(monkeypatch):
  """Records the pipeline planner's host-timed measurements: (the
  `timing.HostTimer`s whose durations were read, the `repeats` of each
  `costs.measure_layers` call: 0 when it gives sizes only)."""
  from dist_loop.parallel.modes.pipeline import costs, timing  # pylint: disable=g-import-not-at-top
  timers, eager = [], []
  measure_layers = costs.measure_layers

  class Recorded(timing.HostTimer):
    def durations(self):
      timers.append(self)
      return super().durations()

  def sizes_only(*args, repeats=3, **kwargs):
    eager.append(repeats)
    return measure_layers(*args, repeats=repeats, **kwargs)

  monkeypatch.setattr(timing, "HostTimer", Recorded)
  monkeypatch.setattr(costs, "measure_layers", sizes_only)
  return timers, eager
