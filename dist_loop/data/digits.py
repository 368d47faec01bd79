"""Handwritten digits: real data that ships with the package, offline.

1,797 8x8 grey images of 10 classes, scaled to [0, 1]. Image models get them
resized (the seed CNN: 28x28x1); flat models take the 8x8x1 images as they are.
A fixed 20% is held out for evaluation.

`digits.csv.gz` is the test set of the UCI "Optical Recognition of
Handwritten Digits" data (E. Alpaydin, C. Kaynak, 1998; CC BY 4.0), in the
copy scikit-learn ships as `load_digits`: one row per image, 64 pixel counts
in 0..16, then the label. It is read here rather than through scikit-learn
because Keras imports scikit-learn (and SciPy) whenever it is installed,
which adds about 1.4 s to every process's start.
"""

import gzip
import os

import numpy as np

from dist_loop.data.base import DATASETS, Dataset, holdout, resize_images

HOLDOUT_SEED = 0
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                    "digits.csv.gz")


@DATASETS.register("digits")
def load(data_dir, seed, image_size=None) -> Dataset:
  del data_dir, seed  # The split is fixed, so eval numbers compare across runs.
  with gzip.open(PATH, "rt") as f:
    rows = np.loadtxt(f, delimiter=",")
  x = (rows[:, :-1].reshape(-1, 8, 8) / 16.0).astype(np.float32)[..., None]
  x = resize_images(x, image_size)
  y = rows[:, -1].astype(np.int32)
  return holdout(x, y, 10, 0.2, HOLDOUT_SEED)


# 8x8x1 images, or the size a model asks for.
load.input_rank = 3
load.images = True
load.input_dtype, load.task = "float32", "classification"
