"""Runs a pipeline schedule inside one traced step.

`PipelineExecutor.step(x, y)` is called inside a `tf.function`. It unrolls the
schedule into ops: every (replica, device, action) becomes a block of ops
under `tf.device(the device)`, and each block waits, by control dependency,
for the previous action of the same device. So each device runs exactly
the order the schedule gives, and across devices only data moves. What an
action builds is the chunk's (`chunk.py`): F, I, W or B of one micro-batch.

On the model's last chunk, F ends with the step core (`dist_loop.training.step.
shares`): the micro-batch's share of the update's loss and metrics, with
R*M contributors, so the shares sum to the global-batch mean.

Regularisation terms (`layer.losses`) belong to the chunk whose layers make
them. F adds its chunk's terms to a scalar that travels with the
activations, so the last chunk hands the micro-batch's whole regularisation
to `shares`, which adds 1/(R*M) of it (the step core's rule); the backward
sends d(loss)/d(scalar) back beside the activation gradient. A model without
such terms sends nothing extra.

With float16 loss scaling (`step(..., loss_scale=scale)`) the last chunk
differentiates loss * scale, so every activation gradient sent between
chunks is scaled and small ones do not underflow in float16. Parameter
gradients are accumulated and reduced scaled; the caller unscales them once
(precision.py). The scale is read once per step, for all chunks.

After the schedule, each chunk's gradients are reduced across the R
data-parallel replicas (hybrid mode): one flat vector per replica, summed on
the chunk's device of replica 0, where the master variables live.

A timed step (`timed=True`) brackets each action with two timestamps on its
device (see `_stamp`): the start waits for the action's inputs and its
predecessor, the action's ops (from a copy of its inputs) wait for the
start, and the end waits for its outputs. They give the measured bubble and
the timeline. An untimed step has neither stamps nor copies.
"""

from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from dist_loop.parallel.modes.pipeline import schedule as schedule_lib
from dist_loop.training import step as step_core
from dist_loop.parallel.modes.pipeline.action import (BACKWARD, FORWARD, INPUT_GRAD,
                                             WEIGHT_GRAD)
from dist_loop.parallel.modes.pipeline.chunk import Chunk
from dist_loop.parallel.modes.pipeline.schedule import Schedule
from dist_loop.tasks import Task


class PipelineExecutor:
  """A pipeline of chunks on K devices, replicated R times, for one schedule."""

  def __init__(self, chunk_layers: Sequence[Sequence[object]],
               schedule: Schedule, device_grid: Sequence[Sequence[str]],
               num_microbatches: int, task: Task, examples_per_update: int,
               recompute: str = "never", jit_compile: bool = False):
    """Prepares the chunks and the clocks.

    Args:
      chunk_layers: the model's layers, cut into the schedule's chunks.
      schedule: per-device action lists and chunk placement.
      device_grid: device_grid[r][d] is device d of replica r; replica 0's
        devices hold the variables.
      num_microbatches: M, per replica.
      task: what is learned (the loss and metrics of the last chunk).
      examples_per_update: the global batch, over all replicas.
      recompute: one of `options.RECOMPUTE`.
      jit_compile: each chunk's F compiled with XLA (`chunk.py`).
    """
    self.schedule = schedule
    self.order = schedule_lib.execution_order(schedule)
    self.num_chunks = schedule.num_chunks
    self.device_grid = [list(row) for row in device_grid]
    self.num_replicas = len(self.device_grid)
    self.num_microbatches = num_microbatches
    self.task = task
    self.examples_per_update = examples_per_update
    last = self.num_chunks - 1
    split_backward = {a.chunk for row in schedule.devices for a in row
                      if a.kind == INPUT_GRAD}
    self.chunks = [
        Chunk(layers, first=c == 0,
              recompute=recompute == "always" or (
                  recompute == "except_last" and c < last),
              head=self._head if c == last else None,
              split_backward=c in split_backward, jit_compile=jit_compile)
        for c, layers in enumerate(chunk_layers)]
    self._clocks = []  # One per device: see `_stamp`.
    for row in self.device_grid:
      self._clocks.append([])
      for device in row:
        with tf.device(device):
          self._clocks[-1].append(
              tf.Variable(0.0, dtype=tf.float64, trainable=False))

  @property
  def variables(self) -> List[tf.Variable]:
    """All trainable variables, chunk by chunk: the model's order."""
    return [v for chunk in self.chunks for v in chunk.variables]

  def _head(self, out, reg, labels, loss_scale):
    share = step_core.shares(
        self.task, out, labels, examples_per_update=self.examples_per_update,
        regularization=None if reg is None else [reg],
        contributors=self.num_replicas * self.num_microbatches)
    target = share["loss"]
    return (target if loss_scale is None else target * loss_scale), share

  def _stamp(self, r, d):
    """`tf.timestamp()` on device (r, d), ordered only with that device.

    A bare `tf.timestamp` is a stateful op without resource inputs, and
    `tf.function`'s automatic control dependencies run all such ops in the
    order they were created: every device would wait for the others' stamps,
    and the pipeline would run strictly one action at a time. Inside a
    function that writes the device's own clock variable, the stamp is only
    ordered with the other users of that variable, i.e. with its own device.
    """
    return _stamp_into(self._clocks[r][d])

  # -- one step --

  def step(self, x: tf.Tensor, y: tf.Tensor,
           loss_scale: Optional[tf.Tensor] = None,
           timed: bool = False) -> Dict[str, object]:
    """Builds one pipelined step on the global batch (x, y). Call traced.

    Args:
      x, y: the global batch.
      loss_scale: a float32 scalar the backward pass starts from (float16
        loss scaling), or None: no scaling, and no op is added for it.
      timed: add the timestamps of every action.

    Returns:
      grads: reduced gradients, one per variable (see `variables`), on the
        chunk's master device; multiplied by `loss_scale` if given.
      metrics: the task's metrics (`loss` first), as the update's means.
      starts, ends (if timed): float64 [R, K, A] timestamps (seconds) of
        each device's actions in the device's schedule order (A: the most
        actions of a device; shorter rows repeat their last end).
    """
    r_total, m = self.num_replicas, self.num_microbatches
    # Global batch -> R replica shards -> M micro-batches, contiguous, like
    # the sync mode's replica shards; chunk r*M + i is micro-batch i of r.
    xs = tf.split(x, r_total * m)
    ys = tf.split(y, r_total * m)
    shares, accum, stamps = [], [], []
    for r in range(r_total):
      accum.append([None] * self.num_chunks)
      stamps.append([[] for _ in self.device_grid[r]])
      last_op = [[] for _ in self.device_grid[r]]  # Per device.
      sent = {}  # ("F"/"G", chunk, i) -> the tensors passed on.
      records, kept = {}, {}
      for d, action in self.order:
        c, i = action.chunk, action.microbatch
        if action.kind == FORWARD:
          inputs = ([xs[r * m + i], None] if c == 0
                    else sent[("F", c - 1, i)])
        elif action.kind == WEIGHT_GRAD:
          inputs = []
        else:
          inputs = (None if c == self.num_chunks - 1
                    else sent[("G", c + 1, i)])
        with tf.device(self.device_grid[r][d]), tf.name_scope(
            f"r{r}_{action.kind}{i}_c{c}"):
          deps = last_op[d]
          if timed:
            received = [t for t in inputs or [] if t is not None]
            with tf.control_dependencies(deps + received):
              t0 = self._stamp(r, d)
            deps = [t0]
            with tf.control_dependencies(deps):
              inputs = inputs and [None if t is None else tf.identity(t)
                                   for t in inputs]
          with tf.control_dependencies(deps):
            done = self.build_action(action, inputs, ys[r * m + i],
                                     loss_scale, sent, records, kept,
                                     accum[r], shares)
          if timed:
            with tf.control_dependencies(done):
              t1 = self._stamp(r, d)
            stamps[r][d].append((t0, t1))
            done = [t1]
        last_op[d] = done or deps
    out = {"grads": self._reduce(accum),
           "metrics": {name: tf.add_n([s[name] for s in shares])
                       for name in self.task.metric_names}}
    if timed:
      out["starts"], out["ends"] = _stack(stamps)
    return out

  def build_action(self, action, inputs, labels, loss_scale, sent, records,
                   kept, accum, shares) -> List[tf.Tensor]:
    """Builds one action's ops; returns the tensors that end it.

    What it receives is `inputs`, what it sends goes into `sent`; what F
    leaves for the backward and I for W is kept in `records` and `kept`.
    The step builds every action with it, and so do the planner's timers
    (`timing.py`).
    """
    c, i = action.chunk, action.microbatch
    chunk = self.chunks[c]
    last = c == self.num_chunks - 1
    if action.kind == FORWARD:
      record = chunk.forward(inputs[0], inputs[1], labels, loss_scale)
      records[(c, i)] = record
      if last:
        shares.append(record.extra)
        return record.ys + list(record.extra.values())
      sent[("F", c, i)] = [record.ys[0],
                           record.ys[1] if len(record.ys) > 1 else None]
      return list(record.ys)
    if action.kind == WEIGHT_GRAD:
      return self._accumulate(accum, c, chunk.weight_grad(kept.pop((c, i))))
    grads_out = None if last else [g for g in inputs if g is not None]
    if action.kind == INPUT_GRAD:
      to_send, kept[(c, i)] = chunk.input_grad(records.pop((c, i)),
                                               grads_out)
      done = [g for _, pairs in kept[(c, i)].joins for _, g in pairs]
    else:
      assert action.kind == BACKWARD
      to_send, grads = chunk.backward(records.pop((c, i)), grads_out)
      done = self._accumulate(accum, c, grads)
    if c > 0:
      sent[("G", c, i)] = list(to_send) + [None] * (2 - len(to_send))
      done = list(to_send) + done
    return done

  @staticmethod
  def _accumulate(accum, c, grads) -> List[tf.Tensor]:
    accum[c] = grads if accum[c] is None else [
        a + g for a, g in zip(accum[c], grads)]
    return list(accum[c])

  def _reduce(self, accum) -> List[tf.Tensor]:
    """Sums each chunk's gradients over the replicas, onto replica 0."""
    if self.num_replicas == 1:
      return [g for chunk in accum[0] for g in chunk]
    grads = []
    for c in range(self.num_chunks):
      if not accum[0][c]:  # A chunk without variables (e.g. only a Flatten).
        continue
      d = self.schedule.placement[c]
      shapes = [g.shape for g in accum[0][c]]
      sizes = [s.num_elements() for s in shapes]
      packed = []
      for r in range(self.num_replicas):
        with tf.device(self.device_grid[r][d]):
          packed.append(tf.concat([tf.reshape(g, [-1]) for g in accum[r][c]],
                                  0))
      with tf.device(self.device_grid[0][d]):
        total = tf.add_n(packed)  # The one reduction of chunk c.
        grads += [tf.reshape(g, s) for g, s in
                  zip(tf.split(total, sizes), shapes)]
    return grads


def _stack(stamps):
  """[R][K] lists of (start, end) -> two float64 [R, K, A] tensors."""
  width = max(len(row) for rows in stamps for row in rows)
  starts, ends = [], []
  for rows in stamps:
    starts.append([])
    ends.append([])
    for row in rows:
      pad = [row[-1][1]] * (width - len(row))
      starts[-1].append(tf.stack([s for s, _ in row] + pad))
      ends[-1].append(tf.stack([e for _, e in row] + pad))
  return tf.stack(starts), tf.stack(ends)


def bubble(starts: tf.Tensor, ends: tf.Tensor) -> tf.Tensor:
  """Measured idle fraction of one step, averaged over replicas.

  For each replica: span = last end - first start over all its devices;
  busy_k = the summed durations of device k's actions; bubble = 1 -
  sum_k busy_k / (K * span). With equal chunks under GPipe or 1F1B this is
  (K-1)/(M+K-1).
  """
  busy = tf.reduce_sum(ends - starts, axis=-1)  # [R, K]
  span = (tf.reduce_max(ends, axis=[1, 2]) - tf.reduce_min(starts, axis=[1, 2]))
  k = tf.cast(tf.shape(busy)[1], busy.dtype)
  per_replica = 1.0 - tf.reduce_sum(busy, axis=1) / (k * span)
  return tf.reduce_mean(per_replica)


@tf.function(autograph=False)
def _stamp_into(clock: tf.Variable) -> tf.Tensor:
  """Writes the current time (seconds) into `clock` and returns it."""
  clock.assign(tf.timestamp())
  return clock.read_value()
