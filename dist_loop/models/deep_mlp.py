"""A deep, wide MLP: enough compute per layer for pipelining to pay off.

A projection to 512 features, then eight Dense(512, relu) layers, then
the logits. On the seed models a micro-batch is so small that op overhead
dominates and pipelining only adds to it; this model is what the pipeline
benchmark splits into stages (by parameters: 4 + 4 of the wide layers).
"""

import keras

from dist_loop.models.base import MODELS

WIDTH = 512
DEPTH = 8


@MODELS.register("deep_mlp")
def deep_mlp(input_shape, num_classes):
  del input_shape
  return ([keras.layers.Flatten(name="flatten"),
           keras.layers.Dense(WIDTH, activation="relu", name="dense_in")]
          + [keras.layers.Dense(WIDTH, activation="relu", name=f"dense_{i}")
             for i in range(1, DEPTH + 1)]
          + [keras.layers.Dense(num_classes, name="logits")])
