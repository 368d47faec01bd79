"""Checkpoints: one object graph for every mode, written by the chief.

The checkpoint holds `step`, `model` and `optimizer` (see
`Trainer.checkpoint_items`). Every mode builds the same `keras.Sequential`
and one optimizer over all its variables, so a checkpoint written by one mode
restores in another. `tf.train.CheckpointManager` writes each checkpoint under
a new name and only then points `checkpoint` at it, so a crash mid-write
leaves the previous checkpoint as the latest.
"""

import os

import tensorflow as tf
from absl import logging

from dist_loop import data, models

CHECKPOINT_DIR = "checkpoints"


def manager(items, workdir: str, max_to_keep: int) -> tf.train.CheckpointManager:
  """A CheckpointManager over `items` in WORKDIR/checkpoints."""
  checkpoint = tf.train.Checkpoint(**items)
  return tf.train.CheckpointManager(
      checkpoint, os.path.join(workdir, CHECKPOINT_DIR),
      max_to_keep=max_to_keep)


def restore_latest(mgr: tf.train.CheckpointManager, scope) -> bool:
  """Restores the latest checkpoint, if any, under `scope`. Returns whether."""
  if not mgr.latest_checkpoint:
    return False
  with scope:
    mgr.checkpoint.restore(mgr.latest_checkpoint).assert_existing_objects_matched()
  logging.info("Resumed from %s.", mgr.latest_checkpoint)
  return True


def load_model(config, path: str = None):
  """The run's model with the variables of its latest checkpoint (or `path`).

  For evaluation, fine-tuning and tests: no strategy, no optimizer.
  """
  split = data.DATASETS.get(config.dataset)(
      config.data_dir, config.seed, models.image_size_for(config.model))
  model = models.build(config.model, split.input_shape, split.num_classes)
  path = path or tf.train.latest_checkpoint(
      os.path.join(config.workdir, CHECKPOINT_DIR))
  if path is None:
    raise FileNotFoundError(f"no checkpoint in {config.workdir}")
  tf.train.Checkpoint(model=model).restore(path).expect_partial()
  return model
