"""What every dataset loader returns, and the registry they join.

A loader is `fn(data_dir, seed, image_size) -> Dataset`: numpy arrays in memory,
already normalised, with a held-out evaluation split. `image_size` is what the
model asks for (the seed CNN wants 28x28x1); loaders of image data resize to
it, and loaders of feature or text data ignore it. A loader that declares
`Options` (a dataclass of `option(...)` fields: its flags) is also called
with `options=`. Inputs are float32 features or images, or int32 token ids
for a language-model dataset (`data/text.py`), whose labels are the next
token at every position.
"""

import dataclasses
from typing import Optional, Tuple

import numpy as np

from dist_loop.registry import Registry


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A dataset in memory: inputs, int32 labels, train and held-out eval.

  Labels are [n] class ids, or [n, seq_len] next tokens for a language
  model; `num_classes` is then the vocabulary.
  """

  train_x: np.ndarray
  train_y: np.ndarray
  eval_x: np.ndarray
  eval_y: np.ndarray
  num_classes: int
  # The registered task it poses (dist_loop/tasks): what the loss is.
  task: str = "classification"

  @property
  def input_shape(self) -> Tuple[int, ...]:
    return tuple(self.train_x.shape[1:])


DATASETS: Registry = Registry("dataset", "dataset")


def load(config) -> Dataset:
  """The run's dataset: the registered loader of `config.dataset`, asked for
  the image size the model wants, with the dataset's options if the loader
  declares `Options` (it is then called with `options=`)."""
  from dist_loop import models  # pylint: disable=g-import-not-at-top
  loader = DATASETS.get(config.dataset)
  kwargs = {}
  if hasattr(loader, "Options"):
    kwargs["options"] = (config.dataset_options
                         if config.dataset_options is not None
                         else loader.Options())
  return loader(config.data_dir, config.seed,
                models.image_size_for(config.model), **kwargs)


def resize_images(images: np.ndarray, image_size: Optional[int]) -> np.ndarray:
  """Bilinear resize of NHWC images to image_size x image_size."""
  if image_size is None or images.shape[1:3] == (image_size, image_size):
    return images
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = tf.image.resize(images, (image_size, image_size), method="bilinear")
  return out.numpy().astype(np.float32)


def holdout(x: np.ndarray, y: np.ndarray, num_classes: int, eval_fraction: float,
            seed: int) -> Dataset:
  """Splits arrays into train/eval with a fixed permutation of `seed`."""
  order = np.random.RandomState(seed).permutation(len(x))
  n_eval = int(round(len(x) * eval_fraction))
  ev, tr = order[:n_eval], order[n_eval:]
  return Dataset(x[tr], y[tr], x[ev], y[ev], num_classes)
