"""Byte-level text for language models, with no download.

Two datasets, both bytes with a vocabulary of 256 (no tokenizer):

* `--dataset=text --data_file=PATH`: any file, UTF-8 text or binary.
* `--dataset=pysource`: the source of a fixed list of Python standard-library
  modules (`PYSOURCE_FILES`), read from the running interpreter's own
  installation, so it exists offline wherever Python does. About 1.4 MB; the
  exact bytes follow the Python version.

The last 5% of the bytes (rounded up) are held out for evaluation, the rest
is training data; no window crosses the cut. An example is a window of
`seq_len + 1` bytes: the input is its first `seq_len` bytes and the targets
the same bytes shifted by one. Windows start every `seq_len` bytes, so the
inputs do not overlap and every byte after the first of each part is a
target exactly once; a tail shorter than a window is dropped. The windows
are materialised as int32 arrays [num_windows, seq_len] (8 bytes of memory
per byte of data) because the input stream shards example indices.
"""

import dataclasses
import os
import sysconfig
from typing import Optional, Sequence

import numpy as np

from dist_loop.data.base import DATASETS, Dataset
from dist_loop.errors import UserError
from dist_loop.options import option
# The datasets pose this task; importing it registers it.
from dist_loop.tasks import language_model  # pylint: disable=unused-import

VOCAB_SIZE = 256
HELD_OUT_PARTS = 20  # The last 1/20 of the bytes (5%) is held out.
TASK = "language_model"

# Large, pure-Python modules that have kept their path for many releases.
PYSOURCE_FILES = (
    "_pydecimal.py", "inspect.py", "typing.py", "pydoc.py",
    "email/_header_value_parser.py", "tarfile.py", "doctest.py",
    "argparse.py", "subprocess.py", "difflib.py", "logging/__init__.py",
    "enum.py", "pickle.py",
)


def _seq_len_option():
  # One definition, so that both datasets declare `--seq_len` alike.
  return option(128, "Bytes of context per example: the model's input "
                "length.", lower=1, layout=True)


@dataclasses.dataclass(frozen=True)
class TextOptions:
  """`--dataset=text`: which file, and how long an example is."""

  data_file: Optional[str] = option(
      None, "The file --dataset=text trains on: any UTF-8 or binary file, "
      "read as bytes.")
  seq_len: int = _seq_len_option()

  def __post_init__(self):
    if not self.data_file:
      raise UserError("--dataset=text needs --data_file=PATH, the file to "
                      "train on (any UTF-8 or binary file)")


@dataclasses.dataclass(frozen=True)
class PySourceOptions:
  """`--dataset=pysource`: how long an example is."""

  seq_len: int = _seq_len_option()


def min_bytes(seq_len: int) -> int:
  """The shortest data whose held-out part holds one window."""
  # ceil(n / 20) >= seq_len + 1  <=>  n >= 20 * seq_len + 1.
  return HELD_OUT_PARTS * seq_len + 1


def held_out_bytes(n: int) -> int:
  """How many of `n` bytes are held out: 5%, rounded up."""
  return -(-n // HELD_OUT_PARTS)


def windows(data: np.ndarray, seq_len: int):
  """(inputs, targets): int32 [n, seq_len] windows of a uint8 array, each
  starting `seq_len` bytes after the previous one; targets are the inputs
  shifted by one byte."""
  n = (len(data) - 1) // seq_len
  x = data[:n * seq_len].reshape(n, seq_len)
  y = data[1:n * seq_len + 1].reshape(n, seq_len)
  return x.astype(np.int32), y.astype(np.int32)


def from_bytes(data: bytes, seq_len: int, source: str) -> Dataset:
  """The language-model Dataset of `data`: the last 5% held out.

  Args:
    data: the corpus.
    seq_len: bytes of input per example.
    source: how to name the data in an error ("--data_file=notes.txt").

  Raises:
    UserError: the data is empty or too short for one held-out window.
  """
  need = min_bytes(seq_len)
  if not data:
    raise UserError(f"{source} is empty; give a file of at least {need} "
                    f"bytes for --seq_len={seq_len}")
  if len(data) < need:
    fits = (len(data) - 1) // HELD_OUT_PARTS  # The longest seq_len that fits.
    shorter = f" or --seq_len={fits}" if fits >= 1 else ""
    raise UserError(
        f"{source} has {len(data)} bytes, too short for --seq_len={seq_len}: "
        f"its last 5% must hold one window of {seq_len + 1} bytes, so it "
        f"needs at least {need}; use a longer file{shorter}")
  array = np.frombuffer(data, dtype=np.uint8)
  cut = len(array) - held_out_bytes(len(array))
  train_x, train_y = windows(array[:cut], seq_len)
  eval_x, eval_y = windows(array[cut:], seq_len)
  return Dataset(train_x, train_y, eval_x, eval_y, VOCAB_SIZE, task=TASK)


def read_file(path: str) -> bytes:
  """The bytes of `path` for --data_file. Raises a one-line UserError."""
  try:
    with open(os.path.expanduser(path), "rb") as f:
      return f.read()
  except FileNotFoundError:
    raise UserError(f"--data_file={path}: no such file; pass the path of an "
                    "existing file") from None
  except IsADirectoryError:
    raise UserError(f"--data_file={path} is a directory; pass a file") from None
  except OSError as e:
    raise UserError(f"--data_file={path} cannot be read ({e.strerror or e}); "
                    "check its permissions, or pass another file") from None


def pysource_bytes(stdlib_dir: Optional[str] = None,
                   files: Sequence[str] = PYSOURCE_FILES) -> bytes:
  """The `pysource` corpus: `files` of the standard library, concatenated
  in order. Raises a UserError naming the first missing file."""
  stdlib_dir = stdlib_dir or sysconfig.get_paths()["stdlib"]
  parts = []
  for name in files:
    path = os.path.join(stdlib_dir, name)
    try:
      with open(path, "rb") as f:
        parts.append(f.read())
    except OSError as e:
      raise UserError(
          f"--dataset=pysource reads the Python standard library, but {path} "
          f"cannot be read ({e.strerror or e}); use a complete Python "
          "installation, or --dataset=text --data_file=PATH") from None
  return b"".join(parts)


@DATASETS.register("text")
def load_text(data_dir, seed, image_size=None, options=None) -> Dataset:
  del data_dir, seed, image_size  # The split is fixed: the last 5%.
  options = options or TextOptions()
  return from_bytes(read_file(options.data_file), options.seq_len,
                    f"--data_file={options.data_file}")


@DATASETS.register("pysource")
def load_pysource(data_dir, seed, image_size=None, options=None) -> Dataset:
  del data_dir, seed, image_size
  options = options or PySourceOptions()
  return from_bytes(pysource_bytes(), options.seq_len, "--dataset=pysource")


load_text.Options = TextOptions
load_pysource.Options = PySourceOptions
