"""Byte-level text for language models, with no download.

Two datasets, both bytes with a vocabulary of 256 (no tokenizer):

* `--dataset=text --data_file=PATH`: any regular file, UTF-8 text or binary.
* `--dataset=pysource`: the source of a fixed list of Python standard-library
  modules (`corpus.PYSOURCE_FILES`), read from the running interpreter's own
  installation, so it exists offline wherever Python does. About 1.4 MB; the
  exact bytes follow the Python version.

The last 5% of the bytes (rounded up) are held out for evaluation, the rest
is training data; no window crosses the cut. An example is a window of
`seq_len + 1` bytes: the input is its first `seq_len` bytes and the targets
the same bytes shifted by one. Windows start every `seq_len` bytes, so the
inputs do not overlap and every byte after the first of each part is a
target exactly once; a tail shorter than a window is dropped.

Memory: the windows are int32 [num_windows, seq_len] arrays, because the
input stream shards example indices. They are CPU tensors, not numpy arrays,
so that the input stream (every async worker's too) takes them as they are,
without a copy: the inputs are a view of the data as int32 and the targets
one copy of it, 8 bytes per byte of the file. Reading the file takes 2 bytes
per byte, freed before the windows are made, so loading peaks at 8x the
file. Where TensorFlow's oneDNN CPU allocator is on (its default on x86
CPUs with AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX, or with
`TF_ENABLE_ONEDNN_OPTS=1`), freed buffers stay in its pool for later
tensors instead of going back to the system, and the process peaks at
about 10.5x the file. `tests/test_text_data.py` measures both, against
bounds of 10x and 11x that one more copy of the windows (4x) would exceed. A file whose loading would
not fit in the memory available (8 or 11 bytes per byte) is refused before
it is read (`data/corpus.py` checks the file itself).
"""

import dataclasses
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from dist_loop.core.errors import UserError
from dist_loop.core.options import option
from dist_loop.data.base import DATASETS, Dataset
from dist_loop.data.corpus import available_memory, file_size, pysource_bytes
from dist_loop.data.corpus import read_file
# The datasets pose this task; importing it registers it.
from dist_loop.tasks import language_model  # pylint: disable=unused-import

VOCAB_SIZE = 256
HELD_OUT_PARTS = 20  # The last 1/20 of the bytes (5%) is held out.
TASK = "language_model"
# The longest context: attention holds seq_len**2 scores per head and
# example (64 MB at 4096, in float32), so a longer one cannot train here.
MAX_SEQ_LEN = 4096
# Memory per byte of data once the windows are made (see the docstring).
BYTES_PER_BYTE = 8
# A loading process's peak per byte where oneDNN's CPU allocator keeps freed
# buffers (the docstring; the bound `tests/test_text_data.py` measures).
ONEDNN_PEAK_PER_BYTE = 11


def loading_bytes_per_byte() -> int:
  """Memory per byte of the file that loading it needs: the windows', or
  the peak under oneDNN's allocator where TensorFlow runs it."""
  return ONEDNN_PEAK_PER_BYTE if _onednn() else BYTES_PER_BYTE


def _onednn() -> bool:
  try:  # The check TensorFlow's own tests use; no public one exists.
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
    return bool(_pywrap_util_port.IsMklEnabled())
  except (ImportError, AttributeError):
    return False


def _seq_len_option():
  # One definition, so that both datasets declare `--seq_len` alike.
  return option(128, "Bytes of context per example: the model's input "
                "length.", lower=1, upper=MAX_SEQ_LEN, layout=True)


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


def from_bytes(data: bytes, seq_len: int, source: str) -> Dataset:
  """The language-model Dataset of `data`: the last 5% held out.

  Args:
    data: the corpus.
    seq_len: bytes of input per example.
    source: how to name the data in an error ("--data_file=notes.txt").

  Raises:
    UserError: the data is empty or too short for one held-out window.
  """
  _check_length(len(data), seq_len, source)
  return _dataset(lambda: _as_tensor(data), seq_len, source)


def from_file(path: str, seq_len: int) -> Dataset:
  """The language-model Dataset of the file `path` (--data_file).

  Raises:
    UserError: one line naming the file and the fix: it is missing, not a
      regular file, unreadable, empty, too short for `seq_len`, or too large
      for the memory available.
  """
  source = f"--data_file={path}"
  size = file_size(path)
  _check_length(size, seq_len, source)
  per_byte = loading_bytes_per_byte()
  need, available = per_byte * size, available_memory()
  if available is not None and need > available:
    raise UserError(
        f"{source} has {size / 2**20:.0f} MB; loading it needs about "
        f"{need / 2**20:.0f} MB of memory ({per_byte} bytes per byte), "
        f"but {available / 2**20:.0f} MB are available; use a smaller file")
  return _dataset(lambda: _as_tensor(read_file(path)), seq_len, source)


def _check_length(n: int, seq_len: int, source: str) -> None:
  need = min_bytes(seq_len)
  if not n:
    raise UserError(f"{source} is empty; give a file of at least {need} "
                    f"bytes for --seq_len={seq_len}")
  if n < need:
    fits = (n - 1) // HELD_OUT_PARTS  # The longest seq_len that fits.
    shorter = f" or --seq_len={fits}" if fits >= 1 else ""
    raise UserError(
        f"{source} has {n} bytes, too short for --seq_len={seq_len}: "
        f"its last 5% must hold one window of {seq_len + 1} bytes, so it "
        f"needs at least {need}; use a longer file{shorter}")


def _as_tensor(data: bytes) -> tf.Tensor:
  with tf.device("/CPU:0"):
    return tf.constant(np.frombuffer(data, dtype=np.uint8))


def _dataset(read: Callable[[], tf.Tensor], seq_len: int,
             source: str) -> Dataset:
  """The windows of the uint8 tensor `read()` returns.

  `read` is a function so that this frame holds the only reference to the
  bytes, and can free them before the targets, the one copy, are made.
  """
  try:
    with tf.device("/CPU:0"):
      data = read()
      n = int(data.shape[0])
      cut = n - held_out_bytes(n)
      eval_tokens = tf.cast(data[cut:], tf.int32)
      train_tokens = tf.cast(data[:cut], tf.int32)
      del data
      eval_x, eval_y = _windows(eval_tokens, seq_len)
      train_x, train_y = _windows(train_tokens, seq_len)
  except (MemoryError, tf.errors.ResourceExhaustedError):
    raise UserError(f"{source} does not fit in memory as windows "
                    f"({loading_bytes_per_byte()} bytes per byte to load); "
                    "use a smaller file") from None
  return Dataset(train_x, train_y, eval_x, eval_y, VOCAB_SIZE, task=TASK,
                 source=source)


def _windows(tokens: tf.Tensor, seq_len: int):
  """(inputs, targets): int32 [n, seq_len] windows of int32 tokens, each
  starting `seq_len` tokens after the previous one; targets are the inputs
  shifted by one token."""
  n = (int(tokens.shape[0]) - 1) // seq_len
  # A slice from the start shares the tokens' memory; one from the second
  # token is a copy.
  x = tf.reshape(tokens[:n * seq_len], [n, seq_len])
  y = tf.reshape(tokens[1:n * seq_len + 1], [n, seq_len])
  return x, y


@DATASETS.register("text")
def load_text(data_dir, seed, image_size=None, options=None) -> Dataset:
  del data_dir, seed, image_size  # The split is fixed: the last 5%.
  options = options or TextOptions()
  return from_file(options.data_file, options.seq_len)


@DATASETS.register("pysource")
def load_pysource(data_dir, seed, image_size=None, options=None) -> Dataset:
  del data_dir, seed, image_size
  options = options or PySourceOptions()
  return from_bytes(pysource_bytes(), options.seq_len, "--dataset=pysource")


load_text.Options = TextOptions
load_pysource.Options = PySourceOptions
# Windows of int32 byte ids, a next byte to predict at every position.
load_text.input_rank = load_pysource.input_rank = 1
load_text.input_dtype = load_pysource.input_dtype = "int32"
load_text.task = load_pysource.task = TASK
