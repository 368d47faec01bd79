"""A learnable synthetic task: inputs labelled by a fixed random teacher.

The teacher is a random two-layer network, so the labels are a deterministic
but non-linear function of the inputs and a model can learn them to high
accuracy. Default shape: 10 features and 10 classes, like the seed MLP. When a
model asks for images, the inputs are image_size x image_size x 1.
"""

import numpy as np

from dist_loop.data.base import DATASETS, Dataset, holdout

NUM_EXAMPLES = 4096
NUM_FEATURES = 10
NUM_CLASSES = 10
# The data does not depend on the run's --seed: runs with different seeds
# train on the same task, which is what seed sweeps want.
DATA_SEED = 1234


@DATASETS.register("synthetic")
def load(data_dir, seed, image_size=None) -> Dataset:
  del data_dir, seed
  rng = np.random.RandomState(DATA_SEED)
  shape = (NUM_FEATURES,) if image_size is None else (image_size, image_size, 1)
  dim = int(np.prod(shape))
  x = rng.randn(NUM_EXAMPLES, dim).astype(np.float32)
  hidden = np.tanh(x @ rng.randn(dim, 32) / np.sqrt(dim))
  y = np.argmax(hidden @ rng.randn(32, NUM_CLASSES), axis=1).astype(np.int32)
  return holdout(x.reshape((-1,) + shape), y, NUM_CLASSES, 0.2, DATA_SEED)


# Feature vectors, or images of the size a model asks for.
load.input_rank = 1
load.images = True
load.input_dtype, load.task = "float32", "classification"
