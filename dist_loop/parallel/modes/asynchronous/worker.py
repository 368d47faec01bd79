"""One async worker: a model copy on its own device, and its gradient step.

A worker's step is a function of (the master weights it read, the version it
read them at, a batch) -> `Push`. It loads the weights into its own copy and
computes the gradient of the batch's mean loss there with the step core
(`dist_loop/training/step.py`): the worker is the one contributor of its update.
It returns the gradient with the version and the weights it was computed on
(delay compensation needs them). No threads and no queue here: the async
mode's threads call `next_batch` and `compute` in a loop, and the
deterministic tests call them in whatever order they want to force.

With `--precision=mixed_float16` the worker also gets the loss scale in force
when it read the weights: it differentiates loss * scale (so that small
float16 gradients do not underflow), divides the float32 gradients by the same
scale, and records the scale in the `Push`. The applier thus sees true
gradients, and can tell an overflow at the current scale from one at an older,
already halved scale (see applier.py). Other precisions add no scaling op.
"""

import dataclasses
import time
from typing import Dict, List, Tuple

import keras
import tensorflow as tf

from dist_loop.data import Dataset, train_dataset_fn
from dist_loop.tasks import Task
from dist_loop.training import step as step_lib


@dataclasses.dataclass(frozen=True)
class Push:
  """What a worker sends to the applier."""

  worker: int
  version: int  # The master version the gradient was computed on.
  grads: List[tf.Tensor]
  read: List[tf.Tensor]  # The master weights at `version`.
  # The task's metrics of the batch at `read` (means; `loss` among them).
  metrics: Dict[str, tf.Tensor]
  loss_scale: float = 1.0  # The loss scale the gradient was computed at.

  @property
  def loss(self) -> tf.Tensor:
    return self.metrics["loss"]


class Worker:
  """Worker `index` of `num_workers`, pinned to `device`.

  Args:
    index, num_workers: this worker's place; it reads input shard `index`.
    device: where its model copy lives and its step runs.
    model: its model copy, built on `device` (the weights are overwritten
      by every step).
    task: what is learned (the loss and metrics of a batch).
    dataset: the training data.
    batch_size: examples per push (the run's --global_batch_size).
    seed: the input stream's seed.
    loss_scaled: float16 loss scaling (`--precision=mixed_float16`).
    jit_compile: the gradient computation compiled with XLA (`--jit_compile`).
  """

  def __init__(self, index: int, num_workers: int, device: str,
               model: keras.Model, task: Task, dataset: Dataset,
               batch_size: int, seed: int, loss_scaled: bool = False,
               jit_compile: bool = False):
    self.index = index
    self.num_workers = num_workers
    self.device = device
    self.model = model
    self.task = task
    self.batch_size = batch_size
    self.loss_scaled = loss_scaled
    self.jit_compile = jit_compile
    self.steps = 0  # Gradients computed; written by this worker's thread only.
    self.input_s = 0.0  # Seconds `next_batch` waited; the same thread's.
    self._dataset = dataset
    self._seed = seed
    self._iterator = None
    self._step_fn = tf.function(self._step, autograph=False)

  @property
  def name(self) -> str:
    return f"async worker {self.index} on {self.device}"

  def start_input(self, start_step: int) -> None:
    """Opens this worker's input shard at (its) batch `start_step`.

    The global stream is cut into blocks of `num_workers` batches, and worker
    w takes the w-th batch of every block: the shards are disjoint, and with
    one worker the stream is exactly the sync mode's.
    """
    fn = train_dataset_fn(self._dataset.train_x, self._dataset.train_y,
                          self.batch_size * self.num_workers, self._seed,
                          start_step=start_step)
    ctx = tf.distribute.InputContext(num_input_pipelines=self.num_workers,
                                     input_pipeline_id=self.index,
                                     num_replicas_in_sync=self.num_workers)
    self._iterator = iter(fn(ctx))

  def stop_input(self) -> None:
    """Frees this worker's input now (its tf.data threads stop; without
    autotuning, see `data/stream.py`, nothing waits longer)."""
    self._iterator = None

  def trace(self) -> None:
    """Traces the step now (call after `start_input`), so that the threads
    start computing at once instead of tracing side by side."""
    specs = [tf.TensorSpec(v.shape, v.dtype)
             for v in self.model.trainable_variables]
    scale = tf.TensorSpec((), tf.float32) if self.loss_scaled else None
    self._step_fn.get_concrete_function(specs, *self._iterator.element_spec,
                                        scale)

  def next_batch(self) -> Tuple[tf.Tensor, tf.Tensor]:
    """The next batch of this worker's shard; the wait adds to `input_s`."""
    if self._iterator is None:
      self.start_input(0)
    t0 = time.perf_counter()
    batch = next(self._iterator)
    self.input_s += time.perf_counter() - t0
    return batch

  def compute(self, version: int, read: List[tf.Tensor], x, y,
              loss_scale: float = 1.0) -> Push:
    """The gradient of batch (x, y) at the master weights `read`.

    A float16 worker computes it at `loss_scale` and unscales it; the others
    ignore the scale (it is 1.0 without loss scaling).
    """
    # A tensor, not a Python float: one trace serves every scale.
    scale = tf.constant(loss_scale, tf.float32) if self.loss_scaled else None
    grads, metrics = self._step_fn(read, x, y, scale)
    self.steps += 1
    return Push(self.index, version, grads, read, metrics, loss_scale)

  # -- the traced step, on this worker's device --

  def _step(self, read, x, y, scale):
    with tf.device(self.device):
      for var, value in zip(self.model.trainable_variables, read):
        var.assign(value)
      metrics, grads = step_lib.accumulated_gradients(
          self.task, self.model, x, y, chunks=1,
          examples_per_update=self.batch_size, contributors=1, scale=scale,
          jit_compile=self.jit_compile)
      if scale is not None:  # float32 gradients, unscaled before the push.
        grads = [g / scale for g in grads]
      return grads, metrics
