"""Runs a pipeline schedule inside one traced step.

`PipelineExecutor.step(x, y)` is called inside a `tf.function`. It unrolls the
schedule into ops: every (replica, stage, action) becomes a block of ops
under `tf.device(the stage's device)`, and each block waits, by control
dependency, for the previous action of the same stage. So each device runs
exactly the order the schedule gives, and across devices only data moves:

* F i on stage k records stage k's layers on micro-batch i under its own
  `GradientTape` (the activations it keeps are what a schedule's memory is
  about). On the last stage, the step core (`dist_loop.step.shares`) gives
  the micro-batch's share of the update's loss and metrics, with R*M
  contributors, so the shares sum to the global-batch mean.
* B i on stage k: `tape.gradient(out, [input] + stage variables,
  output_gradients=dL/d(out))` is the gradient sent to stage k-1 and the
  stage's parameter gradients, added to the stage's accumulator.

Regularisation terms (`layer.losses`) belong to the stage whose layers make
them. F i adds its stage's terms to a scalar that travels with the
activations, so the last stage hands the micro-batch's whole regularisation
to `shares`, which adds 1/(R*M) of it (the step core's rule); B i sends
d(loss)/d(scalar) back beside the activation gradient. A model without such
terms sends nothing extra.

With float16 loss scaling (`step(..., loss_scale=scale)`) the last stage's
tape differentiates loss * scale, so every activation gradient sent between
stages is scaled and small ones do not underflow in float16. Parameter
gradients are accumulated and reduced scaled; the caller unscales them once
(precision.py). The scale is read once per step, for all stages.

After the schedule, each stage's gradients are reduced across the R
data-parallel replicas (hybrid mode): one flat vector per replica, summed on
the stage's master device, where the master variables live.

Each action is bracketed by two timestamps on its device (see `_stamp`): the
start waits for the action's inputs and its predecessor, the action's ops
wait for the start, and the end waits for its outputs. They give the
measured bubble and the timeline.
"""

from typing import Dict, List, Optional, Sequence

import keras
import tensorflow as tf

from dist_loop import step as step_core
from dist_loop.modes.pipeline import schedule as schedule_lib
from dist_loop.tasks import Task


class PipelineExecutor:
  """A K-stage pipeline, replicated R times, for one schedule."""

  def __init__(self, stage_layers: Sequence[Sequence[keras.layers.Layer]],
               schedule: schedule_lib.Schedule,
               device_grid: Sequence[Sequence[str]], num_microbatches: int,
               task: Task, examples_per_update: int,
               recompute: str = "never"):
    """Prepares the per-stage forward functions and the clocks.

    Args:
      stage_layers: the model's layers, cut into K stages.
      schedule: per-stage action lists (see `schedule.py`).
      device_grid: device_grid[r][k] runs stage k of replica r; replica 0's
        devices hold the variables.
      num_microbatches: M, per replica.
      task: what is learned (the loss and metrics of the last stage).
      examples_per_update: the global batch, over all replicas.
      recompute: one of `options.RECOMPUTE`.
    """
    self.stage_layers = [list(s) for s in stage_layers]
    self.num_stages = len(self.stage_layers)
    self.schedule = schedule
    self.order = schedule_lib.execution_order(schedule)
    self.device_grid = [list(row) for row in device_grid]
    self.num_replicas = len(self.device_grid)
    self.num_microbatches = num_microbatches
    self.task = task
    self.examples_per_update = examples_per_update
    self.stage_variables = [
        [v for layer in layers for v in layer.trainable_variables]
        for layers in self.stage_layers]
    # One clock per device: see `_stamp`.
    self._clocks = []
    for row in self.device_grid:
      self._clocks.append([])
      for device in row:
        with tf.device(device):
          self._clocks[-1].append(
              tf.Variable(0.0, dtype=tf.float64, trainable=False))
    self._forward = []
    for k in range(self.num_stages):
      fn = _stage_fn(self.stage_layers[k])
      last = k == self.num_stages - 1
      if recompute == "always" or (recompute == "except_last" and not last):
        fn = tf.recompute_grad(fn)
      self._forward.append(fn)

  def _stamp(self, r, k):
    """`tf.timestamp()` on device (r, k), ordered only with that device.

    A bare `tf.timestamp` is a stateful op without resource inputs, and
    `tf.function`'s automatic control dependencies run all such ops in the
    order they were created: every device would wait for the others' stamps,
    and the pipeline would run strictly one action at a time. Inside a
    function that writes the device's own clock variable, the stamp is only
    ordered with the other users of that variable, i.e. with its own device.
    """
    return _stamp_into(self._clocks[r][k])

  @property
  def variables(self) -> List[tf.Variable]:
    """All trainable variables, stage by stage: the model's order."""
    return [v for vs in self.stage_variables for v in vs]

  # -- one step --

  def step(self, x: tf.Tensor, y: tf.Tensor,
           loss_scale: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
    """Builds one pipelined step on the global batch (x, y). Call traced.

    Args:
      x, y: the global batch.
      loss_scale: a float32 scalar the backward pass starts from (float16
        loss scaling), or None: no scaling, and no op is added for it.

    Returns:
      grads: reduced gradients, one per variable (see `variables`), on the
        stage's master device; multiplied by `loss_scale` if given.
      metrics: the task's metrics (`loss` first), as the update's means.
      starts, ends: float64 [R, K, 2M] timestamps (seconds) of each stage's
        actions, in the stage's schedule order.
    """
    r_total, k_total, m = (self.num_replicas, self.num_stages,
                           self.num_microbatches)
    # Global batch -> R replica shards -> M micro-batches, contiguous, like
    # the sync mode's replica shards; chunk r*M + i is micro-batch i of r.
    xs = tf.split(x, r_total * m)
    ys = tf.split(y, r_total * m)
    shares = []
    accum = [[None] * k_total for _ in range(r_total)]
    starts = [[[] for _ in range(k_total)] for _ in range(r_total)]
    ends = [[[] for _ in range(k_total)] for _ in range(r_total)]
    for r in range(r_total):
      last_op = [[] for _ in range(k_total)]  # Per stage: the previous action.
      # (k, "F"/"B", i) -> what is sent on: (tensor, regularisation or None).
      sent = {}
      tapes = {}  # (k, i) -> what B i needs from F i.
      for k, action in self.order:
        i = action.microbatch
        if action.kind == schedule_lib.FORWARD:
          inp = (xs[r * m + i], None) if k == 0 else sent[(k - 1, "F", i)]
        else:
          inp = (None, None) if k == k_total - 1 else sent[(k + 1, "B", i)]
        with tf.device(self.device_grid[r][k]):
          with tf.control_dependencies(last_op[k] + [
              t for t in inp if t is not None]):
            t0 = self._stamp(r, k)
          with tf.control_dependencies([t0]):
            if action.kind == schedule_lib.FORWARD:
              done = self._forward_action(r, k, i, inp, ys, tapes, sent,
                                          shares, loss_scale)
            else:
              done = self._backward_action(r, k, i, inp, tapes, sent, accum)
          with tf.control_dependencies(done):
            t1 = self._stamp(r, k)
        last_op[k] = [t1]
        starts[r][k].append(t0)
        ends[r][k].append(t1)
    return {"grads": self._reduce(accum),
            "metrics": {name: tf.add_n([s[name] for s in shares])
                        for name in self.task.metric_names},
            "starts": tf.stack([[tf.stack(s) for s in row] for row in starts]),
            "ends": tf.stack([[tf.stack(e) for e in row] for row in ends])}

  def _forward_action(self, r, k, i, inp, ys, tapes, sent, shares,
                      loss_scale):
    """F i on stage k of replica r; returns the tensors that end it.

    On the last stage the tape's target, where B i starts, is the share of
    the loss times `loss_scale` if given; `shares` gets the unscaled share.
    """
    # The received copies, on this device.
    x, reg_in = (None if t is None else tf.identity(t) for t in inp)
    with tf.GradientTape() as tape:
      tape.watch(x)
      if reg_in is not None:
        tape.watch(reg_in)
      out, *losses = self._forward[k](x)
      reg = reg_in
      if losses:
        reg = tf.add_n(([] if reg_in is None else [reg_in]) + losses)
      if k == self.num_stages - 1:
        share = step_core.shares(
            self.task, out, ys[r * self.num_microbatches + i],
            examples_per_update=self.examples_per_update,
            regularization=None if reg is None else [reg],
            contributors=self.num_replicas * self.num_microbatches)
        target = share["loss"]
        if loss_scale is not None:
          target *= loss_scale
    if k == self.num_stages - 1:
      shares.append(share)
      tapes[(k, i)] = (tape, x, reg_in, [target])
      return [target] + list(share.values())
    outputs = [out] + ([] if reg is None else [reg])
    tapes[(k, i)] = (tape, x, reg_in, outputs)
    sent[(k, "F", i)] = (out, reg)
    return outputs

  def _backward_action(self, r, k, i, grad_out, tapes, sent, accum):
    """B i on stage k of replica r; returns the tensors that end it.

    `grad_out` is (d/d output, d/d regularisation or None) from stage k+1,
    or (None, None) on the last stage, whose target is the loss itself.
    """
    tape, x, reg_in, targets = tapes.pop((k, i))
    received = [x] + ([] if reg_in is None else [reg_in])
    variables = self.stage_variables[k]
    output_gradients = None
    if grad_out[0] is not None:
      output_gradients = [g for g in grad_out if g is not None]
    grads = tape.gradient(targets, received + variables,
                          output_gradients=output_gradients,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    to_send = grads[:len(received)]
    if k > 0:
      sent[(k, "B", i)] = (to_send[0], to_send[1] if reg_in is not None
                           else None)
    var_grads = [tf.convert_to_tensor(g) for g in grads[len(received):]]
    if accum[r][k] is None:
      accum[r][k] = var_grads
    else:
      accum[r][k] = [a + g for a, g in zip(accum[r][k], var_grads)]
    return (to_send if k > 0 else []) + accum[r][k]

  def _reduce(self, accum) -> List[tf.Tensor]:
    """Sums each stage's gradients over the replicas, onto replica 0."""
    if self.num_replicas == 1:
      return [g for stage in accum[0] for g in stage]
    grads = []
    for k in range(self.num_stages):
      if not accum[0][k]:  # A stage without variables (e.g. only a Flatten).
        continue
      shapes = [g.shape for g in accum[0][k]]
      sizes = [s.num_elements() for s in shapes]
      packed = []
      for r in range(self.num_replicas):
        with tf.device(self.device_grid[r][k]):
          packed.append(tf.concat([tf.reshape(g, [-1]) for g in accum[r][k]],
                                  0))
      with tf.device(self.device_grid[0][k]):
        total = tf.add_n(packed)  # The one reduction of stage k.
        grads += [tf.reshape(g, s) for g, s in
                  zip(tf.split(total, sizes), shapes)]
    return grads


def _stage_fn(layers):
  """The forward of a stage: its output, then its layers' regularisation
  terms of this call (float32), as one flat tuple, which is what
  `tf.recompute_grad` can wrap."""

  def forward(x):
    for layer in layers:
      x = layer(x, training=True)
    losses = [tf.cast(l, tf.float32) for layer in layers for l in layer.losses]
    return (x, *losses)

  return forward


def bubble(starts: tf.Tensor, ends: tf.Tensor) -> tf.Tensor:
  """Measured idle fraction of one step, averaged over replicas.

  For each replica: span = last end - first start over all its stages;
  busy_k = the summed durations of stage k's actions; bubble = 1 -
  sum_k busy_k / (K * span). With equal stages this is (K-1)/(M+K-1).
  """
  busy = tf.reduce_sum(ends - starts, axis=-1)  # [R, K]
  span = (tf.reduce_max(ends, axis=[1, 2]) - tf.reduce_min(starts, axis=[1, 2]))
  k = tf.cast(tf.shape(busy)[1], busy.dtype)
  per_replica = 1.0 - tf.reduce_sum(busy, axis=1) / (k * span)
  return tf.reduce_mean(per_replica)


@tf.function
def _stamp_into(clock: tf.Variable) -> tf.Tensor:
  """Writes the current time (seconds) into `clock` and returns it."""
  clock.assign(tf.timestamp())
  return clock.read_value()
