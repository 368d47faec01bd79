"""Worked example: a deeper residual CNN for digits, as one file.

It shows the whole recipe for a new model: a builder that returns an ordered
list of Keras layers ending in logits, one `@MODELS.register`, and
`--user_modules=experiments.extensions.residual_cnn` on the command line
(or in the flagfile) to load it. Because the list is flat, the
pipeline mode can cut it into stages without knowing anything about it:
`residual_cnn_pipeline.flags` splits it into 4 stages, two layers each.

A residual block is a small custom layer (two 3x3 convolutions and a skip
connection), so a stage boundary can never cut a skip connection in half.
"""

import keras

from dist_loop.models import MODELS


class ResidualBlock(keras.layers.Layer):
  """relu(x + conv(relu(conv(x)))), with the same number of channels."""

  def __init__(self, filters: int, **kwargs):
    super().__init__(**kwargs)
    self.conv1 = keras.layers.Conv2D(filters, 3, padding="same",
                                     activation="relu")
    self.conv2 = keras.layers.Conv2D(filters, 3, padding="same")

  def build(self, input_shape):
    self.conv1.build(input_shape)
    self.conv2.build(self.conv1.compute_output_shape(input_shape))

  def call(self, x):
    return keras.ops.relu(x + self.conv2(self.conv1(x)))

  def compute_output_shape(self, input_shape):
    return input_shape


@MODELS.register("residual_cnn")
def residual_cnn(input_shape, num_classes):
  """Stem, 4 residual blocks (a pool after the second), pool, logits."""
  del input_shape
  width = 16
  return [
      keras.layers.Conv2D(width, 3, padding="same", activation="relu",
                          name="stem"),
      ResidualBlock(width, name="block_1"),
      ResidualBlock(width, name="block_2"),
      keras.layers.MaxPooling2D(2, name="pool"),
      ResidualBlock(width, name="block_3"),
      ResidualBlock(width, name="block_4"),
      keras.layers.GlobalAveragePooling2D(name="global_pool"),
      keras.layers.Dense(num_classes, name="logits"),
  ]


# Digits are 8x8; 16x16 gives the convolutions room at a small cost.
residual_cnn.image_size = 16
