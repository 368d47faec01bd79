"""dist_loop: hand-written TensorFlow 2 training loops across devices.

The library never reads flags: build a `Config` and call `run(config)`.
"""

import os

# TensorFlow's C++ start-up chatter hides our own output; keep its errors.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from dist_loop.config import Config  # pylint: disable=g-import-not-at-top
from dist_loop.errors import NonFiniteError, UserError


def make_config(**fields):
  """See `dist_loop.configure.make_config`: a Config from flat flag values."""
  from dist_loop import configure  # pylint: disable=g-import-not-at-top
  return configure.make_config(**fields)


def run(config, flags_text=None, cluster=None):
  """See `dist_loop.train.run`. Imported lazily: it pulls in TensorFlow."""
  from dist_loop import train  # pylint: disable=g-import-not-at-top
  return train.run(config, flags_text, cluster)


__all__ = ["Config", "NonFiniteError", "UserError", "make_config", "run"]
