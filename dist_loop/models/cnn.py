"""A small CNN: the second seed article's model, for 28x28x1 images."""

import keras

from dist_loop.models.base import MODELS


@MODELS.register("cnn")
def cnn(input_shape, num_classes):
  """Conv 32 3x3 relu -> MaxPool 2x2 -> Flatten -> Dense 128 relu -> Dense."""
  del input_shape
  return [
      keras.layers.Conv2D(32, 3, activation="relu", name="conv"),
      keras.layers.MaxPooling2D(2, name="pool"),
      keras.layers.Flatten(name="flatten"),
      keras.layers.Dense(128, activation="relu", name="dense_1"),
      keras.layers.Dense(num_classes, name="logits"),
  ]


cnn.image_size = 28
# The classic model-parallel split: conv+pool | flatten+dense+dense.
cnn.split_points = {2: (2,)}
