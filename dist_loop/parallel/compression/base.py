"""The compressor interface, its registry, and the collectives it uses.

A compressor decides what each replica hands to the collectives of the
explicit all-reduce, and rebuilds from their results the SUM over replicas
of the gradients (exactly, or an approximation of it). Adding one is one
class and one registration:

    @reducers.compressed("mine")
    class Mine(Compressor):
      Options = MineOptions  # Optional: a dataclass of `option(...)` fields.
      def reduce(self, grads, state, step): ...
      def wire_bytes(self): ...

`--reducer=mine` then selects it (`dist_loop/parallel/reducers`), and its
`Options` are its flags. A compressor that keeps state between steps
(error-feedback residuals, PowerSGD's Q) returns its initial value from
`initial_state`; the reducer keeps one copy per replica, hands the
replica's own to `reduce`, and checkpoints every replica's (`state.py`).
"""

import abc
import dataclasses
from typing import Dict, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from dist_loop.core.options import option
from dist_loop.core.registry import Registry

COMPRESSORS: Registry = Registry("all-reduce compressor",
                                 "allreduce_compression")

# {name: [one array or tensor per state entry]}.
StateDict = Dict[str, List]

# The default bucket. 4 MB cuts the 3-8 MB gradients of the benchmark
# models into a few buckets; DDP's 25 MB would leave them in one. Across two
# processes on this project's 2-core machine it measured within the spread
# of one bucket, and 1 MB buckets (one more round trip each) slowest
# (docs/benchmarks.md, "Scaling across processes").
BUCKET_MB = 4.0


@dataclasses.dataclass(frozen=True)
class BucketOptions:
  """The options of a compressor, or a reducer, that sends buckets."""

  allreduce_bucket_mb: float = option(
      BUCKET_MB, "Gradients travel in buckets of at least this many MB on the "
      "wire, last layers first, each all-reduce depending only on its own "
      "gradients, so it may start during the rest of the backward pass (0: "
      "one bucket, after the whole backward pass). Measured across two "
      "one-core CPU workers: no gain over one bucket, and more exposed time "
      "on deep_mlp (docs/communication.md).", lower=0.0, upper=4096.0)


class Compressor(abc.ABC):
  """How one replica's gradients travel through the all-reduce.

  Built once per run, outside any `tf.function`. `reduce` runs in replica
  context (inside `strategy.run`) on every replica, which all call the same
  collectives in the same order.

  Attributes:
    Options: the dataclass of this compressor's flags (None: it has none).
    options: an instance of `Options` (None without one).
    shapes: the gradients' shapes, in the order `reduce` receives them.
    dtypes: the gradients' dtypes (the trainable variables').
    seed: the run's seed, for any random initial state; every replica and
      every process must start from the same.
    communication: the `CommunicationOptions` of every collective: the
      bucket size (`--allreduce_bucket_mb`, else `BUCKET_MB`) if the
      compressor takes buckets.
    exact_steps: the trainer sums steps 0 .. `exact_steps` - 1 exactly, in
      float32, and calls `reduce` from then on (PowerSGD's warm-up).

  Buckets. `all_reduce` hands the whole list to one collective call; with a
  bucket size, TensorFlow's collective all-reduce reverses the list, cuts
  it into packs of at least that many bytes and all-reduces each pack as
  its own collective, ordered on every worker alike by the collective ops'
  ordering token. A pack depends only on its own gradients, so the last
  layers' packs travel while the first layers' gradients are still being
  computed (PyTorch DDP's reverse-order buckets, Horovod's tensor fusion).
  A compressor whose collectives need every gradient first (PowerSGD, top-k)
  sets `takes_buckets = False`: the bucket size does not apply to it, and
  its `Options` do not declare one, so asking for one is refused.
  """

  Options = None
  exact_steps: int = 0
  takes_buckets = True

  def __init__(self, options, variables: Sequence, seed: int = 0):
    self.options = options
    self.shapes = [tf.TensorShape(v.shape) for v in variables]
    self.dtypes = [tf.as_dtype(v.dtype) for v in variables]
    self.seed = seed
    bucket_mb = getattr(options, "allreduce_bucket_mb", BUCKET_MB)
    bucket = int(bucket_mb * 2**20) if self.takes_buckets else 0
    self.communication = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=bucket)

  @classmethod
  def check(cls, options) -> None:
    """Rules between this compressor's options. Raises UserError."""
    del options

  def initial_state(self) -> StateDict:
    """Per-replica state (the same initial value on every replica)."""
    return {}

  @abc.abstractmethod
  def reduce(self, grads: List[tf.Tensor], state: StateDict, step: tf.Tensor
             ) -> Tuple[List[tf.Tensor], StateDict]:
    """One replica's part of the all-reduce, in replica context.

    Args:
      grads: the replica's gradients as dense tensors (its share of the
        step's mean loss, unscaled if it has state), one per variable.
      state: the replica's own state, structured as `initial_state`.
      step: the int64 step being taken (0 for the first).

    Returns:
      (the SUM over replicas of the gradients, or its approximation, the
      same on every replica; the replica's new state).
    """

  @abc.abstractmethod
  def wire_bytes(self) -> int:
    """Bytes one replica hands to the collectives in one `reduce`."""

  # -- bytes on the wire --

  def exact_bytes(self) -> int:
    """Bytes one replica hands to an exact all-reduce of the gradients."""
    return sum(nbytes(s, d) for s, d in zip(self.shapes, self.dtypes))

  def bytes_at(self, step: int) -> int:
    """Bytes one replica hands to the collectives in step `step`."""
    return self.exact_bytes() if step < self.exact_steps else self.wire_bytes()

  def bytes_total(self, steps: int) -> int:
    """Bytes one replica handed to the collectives in steps 0..steps-1."""
    exact = min(steps, self.exact_steps)
    return exact * self.exact_bytes() + (steps - exact) * self.wire_bytes()

  # -- helpers for subclasses --

  def all_reduce(self, tensors: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """SUM over replicas of each tensor, in one collective call."""
    if not tensors:
      return []
    ctx = tf.distribute.get_replica_context()
    return list(ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(tensors),
                               options=self.communication))

  def all_gather(self, tensor: tf.Tensor) -> tf.Tensor:
    """Every replica's `tensor`, concatenated along axis 0."""
    ctx = tf.distribute.get_replica_context()
    return ctx.all_gather(tensor, axis=0, options=self.communication)


def is_compressible(shape: tf.TensorShape, min_elements: int) -> bool:
  """Whether a gradient is a matrix worth compressing: at least 2-D, with
  more than one row and column as `as_matrix` shapes it, and at least
  `min_elements` elements. Vectors (biases) and tiny tensors are not."""
  if shape.rank < 2:
    return False
  rows, cols = matrix_shape(shape)
  return rows > 1 and cols > 1 and rows * cols >= min_elements


def matrix_shape(shape: tf.TensorShape) -> Tuple[int, int]:
  """A gradient as a matrix: every axis but the last, by the last (a Keras
  kernel's inputs by its outputs)."""
  dims = shape.as_list()
  return int(np.prod(dims[:-1])), int(dims[-1])


def pack(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
  """The tensors flattened into one vector (for one packed collective)."""
  return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def unpack(vector: tf.Tensor, shapes: Sequence[tf.TensorShape]
           ) -> List[tf.Tensor]:
  """`pack` undone."""
  sizes = [s.num_elements() for s in shapes]
  return [tf.reshape(part, s)
          for part, s in zip(tf.split(vector, sizes), shapes)]


def nbytes(shape, dtype) -> int:
  return int(np.prod(tf.TensorShape(shape).as_list())) * tf.as_dtype(
      dtype).size
