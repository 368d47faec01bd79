"""dist_loop: hand-written TensorFlow 2 training loops across devices.

The library never reads flags: build a `Config` and call `run(config)`.
It never sets up logging either: how much TensorFlow prints is the entry
point's choice (`dist_loop/runtime/console.py`).
"""

import os

# Keras 3 picks its backend at import; the library is written for
# TensorFlow's.
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from dist_loop.core.config import Config  # pylint: disable=g-import-not-at-top
from dist_loop.core.errors import DivergedError, NonFiniteError, UserError


def make_config(**fields):
  """See `dist_loop.configure.make_config`: a Config from flat flag values."""
  from dist_loop import configure  # pylint: disable=g-import-not-at-top
  return configure.make_config(**fields)


def run(config, flags_text=None, cluster=None):
  """See `dist_loop.train.run`. Imported lazily: it pulls in TensorFlow."""
  from dist_loop import train  # pylint: disable=g-import-not-at-top
  return train.run(config, flags_text, cluster)


def load_model(config, path=None):
  """See `dist_loop.control.weights.load_model`: a run's latest weights."""
  from dist_loop.control import weights  # pylint: disable=g-import-not-at-top
  return weights.load_model(config, path)


__all__ = ["Config", "DivergedError", "NonFiniteError", "UserError",
           "load_model", "make_config", "run"]
