"""The model registry and what a model is here.

A model is an ordered list of Keras 3 layers that maps inputs to logits,
wrapped in a `keras.Sequential`. Keeping it a flat list is what lets the
pipeline mode cut it into stages. A builder is registered under a name:

    @MODELS.register("mlp")
    def mlp(input_shape, num_classes) -> list[keras.layers.Layer]: ...

A builder may set `builder.image_size = 28` to ask image datasets for inputs
of that size, and `builder.split_points = {2: (2,)}` to name its preferred cut
into K pipeline stages (the layer indices where stages 1..K-1 start).
"""

from typing import Callable, Optional, Sequence

import keras

from dist_loop.registry import Registry

MODELS: Registry = Registry("model", "model")


def image_size_for(model_name: str):
  """The image side length the model wants, or None for any input."""
  return getattr(MODELS.get(model_name), "image_size", None)


def build_for(config, dataset,
              layer_device: Optional[Callable[[int], str]] = None
              ) -> keras.Sequential:
  """`build` with the run's model, precision and model options, for the
  dataset's input shape and classes. What every mode calls."""
  return build(config.model, dataset.input_shape, dataset.num_classes,
               layer_device=layer_device, precision=config.precision,
               options=config.model_options)


def build(model_name: str, input_shape: Sequence[int], num_classes: int,
          layer_device: Optional[Callable[[int], str]] = None,
          precision: str = "float32", options=None) -> keras.Sequential:
  """Builds the registered model with its variables created.

  Args:
    model_name: a registered model.
    input_shape: one example's shape.
    num_classes: logits per example.
    layer_device: optional `fn(layer_index) -> device`; each layer's
      variables are created on that device (the pipeline places its stages
      so). The model and its variable order are the same either way.
    precision: a Keras dtype policy name for the layers ("mixed_bfloat16":
      bfloat16 compute, float32 variables).
    options: the model's options, for a builder that declares `Options`
      (it is then called with `options=`); None: its defaults.
  """
  from dist_loop import precision as precision_lib  # pylint: disable=g-import-not-at-top
  with precision_lib.policy_scope(precision):
    builder = MODELS.get(model_name)
    kwargs = {}
    if hasattr(builder, "Options"):
      kwargs["options"] = options if options is not None else builder.Options()
    layers = builder(tuple(input_shape), num_classes, **kwargs)
  if layer_device is not None:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    x = keras.Input(tuple(input_shape))
    for i, layer in enumerate(layers):
      with tf.device(layer_device(i)):
        x = layer(x)  # A symbolic call builds the layer under the device.
  return keras.Sequential([keras.Input(tuple(input_shape))] + list(layers),
                          name=model_name)
