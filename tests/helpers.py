"""Building a trainer in the test process and reading its variables.

Tests of one mode compare its variables with another's, so they share these
instead of importing them from each other's test files. `conftest.py` holds
the fixtures and the helpers that run whole programs (`run_main`,
`read_events`); this module holds what works on one trainer.
"""

import keras
import numpy as np

from dist_loop import configure, data, devices
from dist_loop.cluster import Cluster
from dist_loop.modes import build_trainer


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


def replica_copies(trainer):
  """Every replica's copy of every trainable variable."""
  return [[t.numpy() for t in
           trainer.strategy.experimental_local_results(v.value)]
          for v in trainer.model.trainable_variables]
