"""The model registry and what a model is here.

A model is an ordered list of Keras 3 layers that maps inputs to logits,
wrapped in a `keras.Sequential`. Keeping it a flat list is what lets the
pipeline mode cut it into stages. A builder is registered under a name:

    @MODELS.register("mlp")
    def mlp(input_shape, num_classes) -> list[keras.layers.Layer]: ...

A builder may set:

* `builder.image_size = 28` to ask image datasets for inputs of that size
  (it then takes examples of rank 3: height, width, channels);
* `builder.input_dtype = "int32"` if its inputs are not float32 (token ids);
* `builder.input_rank = 1` if it takes examples of one rank only (the
  Transformer: a sequence of token ids); a model that flattens its input
  takes any rank and declares none;
* `builder.task = "language_model"` if its logits are not one class per
  example (the default: "classification");
* `builder.split_points` to name its preferred cut into K pipeline stages
  (the layer indices where stages 1..K-1 start): a dict `{K: points}`
  (`{2: (2,)}`), or a function `fn(K, num_layers) -> points or None` for a
  model whose depth is an option (`split_points_for` reads either);
* `builder.Options`, a dataclass of `option(...)` fields: the model's flags;
  the builder is then called with `options=`.
"""

from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import keras

from dist_loop.core.registry import Registry

MODELS: Registry = Registry("model", "model")


class Takes(NamedTuple):
  """What a model takes, as its builder declares it (see above): checked
  against what the dataset gives (`data.gives`) while flags are parsed, so
  that a model and a dataset that do not fit are one line, not a Keras
  traceback from the first build."""

  task: str
  dtype: str
  rank: Optional[int]  # Of one example; None: any.


def takes(model_name: str) -> Takes:
  """The task, input dtype and example rank the registered model takes."""
  builder = MODELS.get(model_name)
  rank = getattr(builder, "input_rank", None)
  if getattr(builder, "image_size", None) is not None:
    rank = 3
  return Takes(getattr(builder, "task", "classification"),
               getattr(builder, "input_dtype", "float32"), rank)


def image_size_for(model_name: str):
  """The image side length the model wants, or None for any input."""
  return getattr(MODELS.get(model_name), "image_size", None)


def split_points_for(model_name: str, num_stages: int, num_layers: int
                     ) -> Optional[Tuple[int, ...]]:
  """The model's own split into `num_stages` stages of its `num_layers`
  built layers, or None if it declares none for that K."""
  declared = getattr(MODELS.get(model_name), "split_points", None)
  if callable(declared):
    points = declared(num_stages, num_layers)
  else:
    points = (declared or {}).get(num_stages)
  return None if points is None else tuple(points)


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
  from dist_loop.training import precision as precision_lib  # pylint: disable=g-import-not-at-top
  with precision_lib.policy_scope(precision):
    builder = MODELS.get(model_name)
    kwargs = {}
    if hasattr(builder, "Options"):
      kwargs["options"] = options if options is not None else builder.Options()
    layers = builder(tuple(input_shape), num_classes, **kwargs)
  dtype = getattr(builder, "input_dtype", "float32")
  if layer_device is not None:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    x = keras.Input(tuple(input_shape), dtype=dtype)
    for i, layer in enumerate(layers):
      with tf.device(layer_device(i)):
        x = layer(x)  # A symbolic call builds the layer under the device.
  return keras.Sequential(
      [keras.Input(tuple(input_shape), dtype=dtype)] + list(layers),
      name=model_name)
