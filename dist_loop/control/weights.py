"""A finished run's weights in a fresh model: for evaluation, fine-tuning, tests.

It sits above data and models (it builds the run's model for its dataset),
which is why it is not part of the runtime's `checkpoints`.
"""

import os
from typing import Optional

import tensorflow as tf

from dist_loop import data, models
from dist_loop.runtime import checkpoints
from dist_loop.runtime.checkpoint_names import CHECKPOINT_DIR


def load_model(config, path: Optional[str] = None):
  """The run's model with the variables of its latest checkpoint (or `path`).

  For evaluation, fine-tuning and tests: no strategy, no optimizer, float32.

  Raises:
    FileNotFoundError: the workdir holds no checkpoint.
  """
  dataset = data.load(config, models.image_size_for(config.model))
  model = models.build(config.model, dataset.input_shape,
                       dataset.num_classes, options=config.model_options)
  path = path or checkpoints.latest(
      os.path.join(config.workdir, CHECKPOINT_DIR))
  if path is None:
    raise FileNotFoundError(f"no checkpoint in {config.workdir}")
  tf.train.Checkpoint(model=model).restore(path).expect_partial()
  return model
