"""scikit-learn's handwritten digits: real data that ships offline.

1,797 8x8 grey images of 10 classes, scaled to [0, 1]. Image models get them
resized (the seed CNN: 28x28x1); flat models take the 8x8x1 images as they are.
A fixed 20% is held out for evaluation.
"""

import numpy as np

from dist_loop.data.base import DATASETS, Dataset, holdout, resize_images

HOLDOUT_SEED = 0


@DATASETS.register("digits")
def load(data_dir, seed, image_size=None) -> Dataset:
  del data_dir, seed  # The split is fixed, so eval numbers compare across runs.
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  bunch = load_digits()
  x = (bunch.images / 16.0).astype(np.float32)[..., None]
  x = resize_images(x, image_size)
  y = bunch.target.astype(np.int32)
  return holdout(x, y, 10, 0.2, HOLDOUT_SEED)
