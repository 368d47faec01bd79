"""What every dataset loader returns, and the registry they join.

A loader is `fn(data_dir, seed, image_size) -> Dataset`: arrays in memory,
already normalised, with a held-out evaluation split. `image_size` is what the
model asks for (the seed CNN wants 28x28x1); loaders of image data resize to
it, and loaders of feature or text data ignore it. A loader that declares
`Options` (a dataclass of `option(...)` fields: its flags) is also called
with `options=`. Inputs are float32 features or images, or int32 token ids
for a language-model dataset (`data/text.py`), whose labels are the next
token at every position.

A loader declares what it gives, so that a model that cannot take it is
refused while the flags are parsed (`gives`, `configure.check_fit`):
`loader.input_rank` (the rank of one example: 1 for feature vectors or
token windows, 3 for images), `loader.images = True` if it gives images of
the size a model asks for (rank 3 then, whatever its own rank),
`loader.input_dtype` ("float32", "int32") and `loader.task`
("classification", "language_model"). `load` checks that the loader kept
its word; what a loader does not declare is checked against the model once
the data is loaded (`configure.check_fit` with `given`).

`load` checks what a loader returns before anything trains (`check`): a file
with the wrong shapes, labels out of range or no examples stops the run with
one line naming the file, instead of failing mid-training or, worse,
"training" on garbage. A loader checks only what its own format needs to be
converted (mnist: images of rank 3); the rules every dataset shares are here.

A dataset too large for memory holds `InputColumn`s in place of its arrays
(`data/shards.py`): each builds its own input, and `data/stream.py` hands
the building to it.
"""

import abc
import dataclasses
from typing import NamedTuple, Optional, Tuple

import numpy as np

from dist_loop.core.errors import UserError
from dist_loop.core.registry import Registry


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A dataset in memory: inputs, int32 labels, train and held-out eval.

  Labels are [n] class ids, or [n, seq_len] next tokens for a language
  model; `num_classes` is then the vocabulary. The arrays are numpy arrays,
  or CPU `tf.Tensor`s where a loader wants the input stream to use them
  without a copy (`data/text.py`: the windows are most of the memory).
  """

  train_x: np.ndarray
  train_y: np.ndarray
  eval_x: np.ndarray
  eval_y: np.ndarray
  num_classes: int
  # The registered task it poses (dist_loop/tasks): what the loss is.
  task: str = "classification"
  # The file the arrays came from, as an error should name it
  # ("/data/mnist.npz", "--data_file=notes.txt"); empty for data made in code.
  source: str = ""

  @property
  def input_shape(self) -> Tuple[int, ...]:
    return tuple(self.train_x.shape[1:])


class InputColumn(abc.ABC):
  """A column of a `Dataset` that stands in for an array and builds its own
  tf.data input (`data/shards.py`: examples in files).

  It has an array's `shape`, `dtype` and length. `data/stream.py`'s input
  functions pass a column of this type its batch, seed and position, and
  take what it builds; anything else is an array they read themselves.
  `check` leaves it to its loader.
  """

  @abc.abstractmethod
  def train_dataset_fn(self, global_batch_size: int, seed: int,
                       start_step: int):
    """`dataset_fn(input_context)` of the training split from step
    `start_step` (the rules of `stream.train_dataset_fn`)."""

  @abc.abstractmethod
  def eval_dataset(self, batch_size: int):
    """The held-out split, in order, last partial batch kept."""

  def check_pipelines(self, pipelines: int) -> None:
    """Refuses (`UserError`) a training input cut into `pipelines` input
    pipelines that this column cannot feed; any number, unless a column
    says otherwise (TFRecord shards: a file per pipeline)."""
    del pipelines


DATASETS: Registry = Registry("dataset", "dataset")


class Gives(NamedTuple):
  """What a dataset gives; None where its loader does not declare it (then
  only the loaded data tells, `given`)."""

  task: Optional[str]
  dtype: Optional[str]
  rank: Optional[int]  # Of one example.


def gives(dataset_name: str, image_size: Optional[int] = None) -> Gives:
  """The task, input dtype and example rank the registered dataset's loader
  declares, when the model asks for images of `image_size` (None: it asks
  for none)."""
  loader = DATASETS.get(dataset_name)
  rank = getattr(loader, "input_rank", None)
  if image_size is not None and getattr(loader, "images", False):
    rank = 3
  return Gives(getattr(loader, "task", None),
               getattr(loader, "input_dtype", None), rank)


def given(dataset: Dataset) -> Gives:
  """What a loaded dataset gives."""
  return Gives(dataset.task, dataset.train_x.dtype.name,
               len(dataset.input_shape))


def load(config, image_size: Optional[int]) -> Dataset:
  """The run's dataset: the registered loader of `config.dataset`.

  Args:
    config: the run's Config (`dataset`, `data_dir`, `seed`, and the
      dataset's options, passed as `options=` to a loader that declares
      `Options`).
    image_size: the image side the model wants
      (`models.image_size_for(config.model)`), or None for any input.
  """
  loader = DATASETS.get(config.dataset)
  kwargs = {}
  if hasattr(loader, "Options"):
    kwargs["options"] = (config.dataset_options
                         if config.dataset_options is not None
                         else loader.Options())
  dataset = loader(config.data_dir, config.seed, image_size, **kwargs)
  check(dataset, config.dataset)
  _check_declaration(dataset, config.dataset,
                     gives(config.dataset, image_size))
  return dataset


def check_pipelines(dataset: Dataset, pipelines: int) -> None:
  """Refuses a dataset whose training input cannot be cut into `pipelines`
  input pipelines (the run's mode says how many: `Trainer.input_pipelines`),
  before anything is written. Arrays feed any number.

  Raises:
    UserError: one line naming the data and the fix.
  """
  if isinstance(dataset.train_x, InputColumn):
    dataset.train_x.check_pipelines(pipelines)


def _check_declaration(dataset: Dataset, name: str, declared: Gives) -> None:
  """Refuses a loader that gave other data than it declares: the parse-time
  check of model and dataset trusted the declaration. What a loader does
  not declare is not compared."""
  got = given(dataset)
  got = Gives(*(None if want is None else have
                for want, have in zip(declared, got)))
  if got != declared:
    raise UserError(f"the loader of --dataset={name} declares {declared} but "
                    f"gave {got}; fix its declaration (data/base.py says how)")


_PARTS = (("train", "train_x", "train_y"), ("eval", "eval_x", "eval_y"))


def check(dataset: Dataset, name: str) -> None:
  """Refuses a dataset no model could train on, naming its file.

  Every split holds at least one example, as many labels as inputs, numeric
  inputs of rank 2 or more with the same example shape in both splits,
  integer labels of shape [n] (a class per example) or the inputs' shape (a
  token per position), and every label in [0, num_classes). Non-finite
  inputs are allowed: what a step does with them is the `--nonfinite`
  policy's business.

  Args:
    dataset: what the loader of `--dataset=name` returned.
    name: the dataset's registered name.

  Raises:
    UserError: one line naming the file (or the loader) and the fix.
  """
  if dataset.source:
    where, fix = dataset.source, "replace the file with a valid one"
  else:
    where, fix = f"the loader of --dataset={name}", "fix that loader"
  if isinstance(dataset.train_x, InputColumn):
    return  # Examples in files: checked against their manifest on loading.
  problem = _problem(dataset)
  if problem:
    raise UserError(f"{where}: {problem}; {fix}")


def _problem(dataset: Dataset) -> Optional[str]:
  """What makes `dataset` unusable, or None."""
  arrays = {}
  for field in ("train_x", "train_y", "eval_x", "eval_y"):
    value = getattr(dataset, field)
    if not hasattr(value, "shape"):
      return f"{field} is a {type(value).__name__}, not an array"
    arrays[field] = np.asarray(value)  # A CPU tensor's memory, not a copy.
  if not isinstance(dataset.num_classes, (int, np.integer)) or (
      dataset.num_classes < 1):
    return f"num_classes is {dataset.num_classes!r}, not a positive integer"
  shape = arrays["train_x"].shape[1:]
  for split, x_name, y_name in _PARTS:
    x, y = arrays[x_name], arrays[y_name]
    if x.ndim < 2 or 0 in x.shape[1:]:
      return (f"the {split} inputs have shape {x.shape}, not [examples, "
              "features...]")
    if x.shape[1:] != shape:
      return (f"the eval inputs' examples have shape {x.shape[1:]}, the "
              f"train inputs' {shape}")
    if not len(x):
      return f"there are no {split} examples"
    if len(y) != len(x):
      return f"{len(x)} {split} inputs but {len(y)} labels"
    if not (np.issubdtype(x.dtype, np.floating)
            or np.issubdtype(x.dtype, np.integer)):
      return f"the {split} inputs are of type {x.dtype}, not numbers"
    if not np.issubdtype(y.dtype, np.integer):
      return f"the {split} labels are of type {y.dtype}, not integers"
    if y.ndim != 1 and y.shape != x.shape:
      return (f"the {split} labels have shape {y.shape}: one per example "
              f"({len(x)},) or one per input position {x.shape}")
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= dataset.num_classes:
      bad = low if low < 0 else high
      return (f"{split} label {bad} is outside the {dataset.num_classes} "
              f"classes 0..{dataset.num_classes - 1}")
  return None


def int32_labels(y: np.ndarray) -> np.ndarray:
  """Integer labels as int32 when every value fits, so that the cast never
  changes a label; otherwise unchanged, for `check` to report."""
  limits = np.iinfo(np.int32)
  if (np.issubdtype(y.dtype, np.integer) and y.size
      and limits.min <= y.min() and y.max() <= limits.max):
    return y.astype(np.int32)
  return y


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
