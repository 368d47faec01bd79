"""Building a trainer in the test process and reading its variables.

Tests of one mode compare its variables with another's, so they share these
instead of importing them from each other's test files. `conftest.py` holds
the fixtures and the helpers that run whole programs (`run_main`,
`read_events`); this module holds what works on one trainer.
"""

import contextlib
import sys

import keras
import numpy as np

from dist_loop import configure, data
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


def make_trainer(config):
  """The config's trainer, built in this process as `train.run` builds it,
  without the controller (no evaluation, checkpoints or summaries)."""
  config = configure.validate(config, Cluster())
  keras.utils.set_random_seed(config.seed)
  return build_trainer(config, devices.configure(config.num_devices, "cpu"),
                       data.load(config), Cluster())


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
