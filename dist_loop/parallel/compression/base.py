"""The compressor interface, its registry, and the collectives it uses.

A compressor decides what each replica hands to the collectives of the
explicit all-reduce, and rebuilds from their results the SUM over replicas
of the gradients (exactly, or an approximation of it). Adding one is one
class and one registration:

    @COMPRESSORS.register("mine")
    class Mine(Compressor):
      def reduce(self, grads, state, step): ...
      def wire_bytes(self): ...

`--allreduce_compression=mine` then selects it: the option's choices are
this registry. A compressor that keeps state between steps (error-feedback
residuals, PowerSGD's Q) returns its initial value from `initial_state`;
the trainer keeps one copy per replica, hands the replica's own to `reduce`,
and checkpoints every replica's (`state.py`).
"""

import abc
import dataclasses
from typing import Dict, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from dist_loop.core.errors import UserError
from dist_loop.core.registry import Registry

COMPRESSORS: Registry = Registry("all-reduce compressor",
                                 "allreduce_compression")

# {name: [one array or tensor per state entry]}.
StateDict = Dict[str, List]


class Compressor(abc.ABC):
  """How one replica's gradients travel through the all-reduce.

  Built once per run, outside any `tf.function`. `reduce` runs in replica
  context (inside `strategy.run`) on every replica, which all call the same
  collectives in the same order.

  Attributes:
    options: the mode's options (`SyncOptions`), this compressor's flags
      among them.
    shapes: the gradients' shapes, in the order `reduce` receives them.
    dtypes: the gradients' dtypes (the trainable variables').
    seed: the run's seed, for any random initial state; every replica and
      every process must start from the same.
    communication: the `CommunicationOptions` of every collective: the
      bucket size (`--allreduce_bucket_mb`) if the compressor takes buckets.
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
  asking for one explicitly is refused (`check_options`).
  """

  # The options of `options` that belong to this compressor: another
  # compressor's, set to a non-default value, is an error (`check_options`).
  option_names: Tuple[str, ...] = ()
  exact_steps: int = 0
  takes_buckets = True

  def __init__(self, options, variables: Sequence, seed: int = 0):
    self.options = options
    self.shapes = [tf.TensorShape(v.shape) for v in variables]
    self.dtypes = [tf.as_dtype(v.dtype) for v in variables]
    self.seed = seed
    bucket = (int(options.allreduce_bucket_mb * 2**20) if self.takes_buckets
              else 0)
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


def check_options(options) -> None:
  """The chosen compressor's rules, and no option of another one.

  An option of another compressor (say `--powersgd_rank` with
  `--allreduce_compression=none`) at a non-default value would be silently
  ignored, so it is refused; at its default it is accepted. So is a bucket
  size for a compressor that cannot take buckets.

  Raises:
    UserError: naming the fix.
  """
  name = options.allreduce_compression
  chosen = COMPRESSORS.get(name)
  defaults = {f.name: f.default for f in dataclasses.fields(options)}
  bucket_mb = options.allreduce_bucket_mb
  if not chosen.takes_buckets and bucket_mb != defaults["allreduce_bucket_mb"]:
    raise UserError(
        f"--allreduce_bucket_mb={bucket_mb:g} does not apply to "
        f"--allreduce_compression={name}: its collectives need every "
        "gradient first, so it cannot send buckets during the backward pass; "
        "drop --allreduce_bucket_mb, or use none, fp16 or bf16")
  for other in COMPRESSORS.names():
    for option in COMPRESSORS.get(other).option_names:
      value = getattr(options, option)
      if option not in chosen.option_names and value != defaults[option]:
        raise UserError(
            f"--{option}={value} is an option of --allreduce_compression="
            f"{other}, and this run uses --allreduce_compression={name}; "
            f"drop --{option}, or use --allreduce_compression={other}")
  chosen.check(options)
