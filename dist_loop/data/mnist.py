"""MNIST from the standard `mnist.npz`, never downloaded.

The file (keys x_train, y_train, x_test, y_test) is read from --data_dir or,
failing that, from the Keras cache (~/.keras/datasets/mnist.npz). Without it
the run stops with a message that names both places. A file that cannot be
read as that archive (truncated, not a zip, missing keys, images not of rank
3) stops it with a line naming the file; `data.load` checks the rest
(labels 0-9, at least one example).
"""

import os
import zipfile
import zlib

import numpy as np

from dist_loop.core.errors import UserError
from dist_loop.data.base import DATASETS, Dataset, int32_labels, resize_images

FILENAME = "mnist.npz"
KEYS = ("x_train", "y_train", "x_test", "y_test")
FORMAT = ("the standard mnist.npz: x_train and x_test uint8 images [n, 28, "
          "28], y_train and y_test labels [n] in 0..9")
# What a damaged archive raises while it is opened or an array inflated.
_READ_ERRORS = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile,
                zlib.error)


def candidate_paths(data_dir):
  paths = []
  if data_dir:
    paths.append(os.path.join(data_dir, FILENAME))
  keras_home = os.environ.get("KERAS_HOME",
                              os.path.join(os.path.expanduser("~"), ".keras"))
  paths.append(os.path.join(keras_home, "datasets", FILENAME))
  return paths


def read_arrays(path: str):
  """The four arrays of an mnist.npz, in `KEYS` order.

  Raises:
    UserError: the file is not such an archive, or its images are not
      [n, height, width] numbers.
  """
  try:
    with open(path, "rb") as f:
      archive = np.load(f, allow_pickle=False)
      if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError("a single array, not an .npz archive")
      with archive:
        missing = [k for k in KEYS if k not in archive.files]
        if missing:
          raise KeyError(f"no {', '.join(missing)}")
        arrays = [archive[k] for k in KEYS]
  except _READ_ERRORS as e:
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise UserError(f"{path} cannot be read as {FILENAME} ({reason}); use "
                    f"{FORMAT}") from None
  for key, x in zip(KEYS[::2], arrays[::2]):
    if (x.ndim != 3 or 0 in x.shape[1:]
        or not np.issubdtype(x.dtype, np.number)):
      raise UserError(f"{path}: {key} is {x.dtype} of shape {x.shape}, not "
                      f"images [n, height, width]; use {FORMAT}")
  return arrays


@DATASETS.register("mnist")
def load(data_dir, seed, image_size=None) -> Dataset:
  del seed
  paths = candidate_paths(data_dir)
  path = next((p for p in paths if os.path.isfile(p)), None)
  other = next((p for p in paths if os.path.exists(p)), None)
  if path is None and other is not None:
    # A directory, FIFO, device or socket (or a link to one): never
    # opened, as reading a FIFO would block and a device never end.
    kind = ("a directory" if os.path.isdir(other)
            else "a FIFO, device or socket")
    raise UserError(
        f"{other} is not a regular file ({kind}); put the standard "
        f"{FILENAME} there, or pass --data_dir=DIR that holds it")
  if path is None:
    raise UserError(
        f"mnist needs {FILENAME}; not found at {' or '.join(paths)}. Put the "
        "standard mnist.npz there, or pass --data_dir=DIR that holds it")
  x_train, y_train, x_test, y_test = read_arrays(path)

  def images(x):
    return resize_images((x.astype(np.float32) / 255.0)[..., None], image_size)

  return Dataset(images(x_train), int32_labels(y_train), images(x_test),
                 int32_labels(y_test), 10, source=path)


# 28x28x1 images, or the size a model asks for.
load.input_rank = 3
load.images = True
load.input_dtype, load.task = "float32", "classification"
