"""MNIST from the standard `mnist.npz`, never downloaded.

The file (keys x_train, y_train, x_test, y_test) is read from --data_dir or,
failing that, from the Keras cache (~/.keras/datasets/mnist.npz). Without it
the run stops with a message that names both places.
"""

import os

import numpy as np

from dist_loop.data.base import DATASETS, Dataset, resize_images
from dist_loop.errors import UserError

FILENAME = "mnist.npz"


def candidate_paths(data_dir):
  paths = []
  if data_dir:
    paths.append(os.path.join(data_dir, FILENAME))
  keras_home = os.environ.get("KERAS_HOME",
                              os.path.join(os.path.expanduser("~"), ".keras"))
  paths.append(os.path.join(keras_home, "datasets", FILENAME))
  return paths


@DATASETS.register("mnist")
def load(data_dir, seed, image_size=None) -> Dataset:
  del seed
  paths = candidate_paths(data_dir)
  path = next((p for p in paths if os.path.isfile(p)), None)
  if path is None:
    raise UserError(
        f"mnist needs {FILENAME}; not found at {' or '.join(paths)}. Put the "
        "standard mnist.npz there, or pass --data_dir=DIR that holds it")
  try:
    with np.load(path) as f:
      arrays = [f[k] for k in ("x_train", "y_train", "x_test", "y_test")]
  except (OSError, ValueError, KeyError) as e:
    raise UserError(f"{path} is not a readable mnist.npz with keys x_train, "
                    f"y_train, x_test, y_test ({e})") from None
  x_train, y_train, x_test, y_test = arrays

  def images(x):
    return resize_images((x.astype(np.float32) / 255.0)[..., None], image_size)

  return Dataset(images(x_train), y_train.astype(np.int32), images(x_test),
               y_test.astype(np.int32), 10)
