"""A small MLP: the first seed article's model, for feature vectors."""

import keras

from dist_loop.models.base import MODELS


@MODELS.register("mlp")
def mlp(input_shape, num_classes):
  """Dense 128 relu -> Dense num_classes, on flattened input (10 features)."""
  del input_shape
  return [
      keras.layers.Flatten(name="flatten"),
      keras.layers.Dense(128, activation="relu", name="dense_1"),
      keras.layers.Dense(num_classes, name="logits"),
  ]
