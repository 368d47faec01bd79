"""The model registry and what a model is here.

A model is an ordered list of Keras 3 layers that maps inputs to logits,
wrapped in a `keras.Sequential`. Keeping it a flat list is what lets the
pipeline mode cut it into stages. A builder is registered under a name:

    @MODELS.register("mlp")
    def mlp(input_shape, num_classes) -> list[keras.layers.Layer]: ...

A builder may set `builder.image_size = 28` to ask image datasets for inputs
of that size.
"""

from typing import Sequence

import keras

from dist_loop.registry import Registry

MODELS: Registry = Registry("model", "model")


def image_size_for(model_name: str):
  """The image side length the model wants, or None for any input."""
  return getattr(MODELS.get(model_name), "image_size", None)


def build(model_name: str, input_shape: Sequence[int],
          num_classes: int) -> keras.Sequential:
  """Builds the registered model with its variables created."""
  layers = MODELS.get(model_name)(tuple(input_shape), num_classes)
  return keras.Sequential([keras.Input(tuple(input_shape))] + list(layers),
                          name=model_name)
