"""Runs a pipeline schedule inside one traced step.

`PipelineExecutor.step(x, y)` is called inside a `tf.function`. It unrolls the
schedule into ops: every (replica, stage, action) becomes a block of ops
under `tf.device(the stage's device)`, and each block waits, by control
dependency, for the previous action of the same stage. So each device runs
exactly the order the schedule gives, and across devices only data moves:

* F i on stage k: records stage k's layers on micro-batch i under its own
  `GradientTape` (the activations it keeps are what a schedule's memory is
  about). The last stage also computes the micro-batch's share of the loss:
  sum of its per-example losses / global batch, so that the sum over all
  micro-batches and replicas is the global-batch mean.
* B i on stage k: `tape.gradient(out, [input] + stage variables,
  output_gradients=dL/d(out))` gives the gradient to send to stage k-1 and the
  stage's parameter gradients, which are added to the stage's accumulator.
  Once the tape is used, its activations can be freed.

With float16 loss scaling (`step(..., loss_scale=scale)`), the last stage's
tape differentiates loss * scale instead of the loss, so the backward pass
starts from d(loss * scale): every activation gradient sent from stage k to
stage k-1 (float16 under mixed_float16) is scaled, which keeps the small
ones from underflowing on the way. The stages' parameter gradients come out
scaled too; they are accumulated and reduced scaled, and the caller unscales
them once, after the reduction, and checks them for overflow (see
precision.py). The scale is read once per step, so all stages and replicas
use the same one.

After the schedule, each stage's accumulated gradients are reduced across
the R data-parallel replicas (hybrid mode): packed into one flat vector per
replica and summed on the stage's master device, one reduction per stage per
step. The master variables live there; the other replicas only read them.

Each action is bracketed by two timestamps taken on its device (see `_stamp`
for why not a bare `tf.timestamp()`): the start stamp waits for the action's
inputs and its predecessor, the action's ops wait for the start stamp, and
the end stamp waits for its outputs. From these (start, end) pairs the
step's measured busy time per stage and bubble are computed, and the
timeline is drawn.
"""

from typing import Dict, List, Optional, Sequence

import keras
import tensorflow as tf

from dist_loop.modes.pipeline import schedule as schedule_lib

RECOMPUTE = ("never", "always", "except_last")


class PipelineExecutor:
  """A K-stage pipeline, replicated R times, for one schedule."""

  def __init__(self, stage_layers: Sequence[Sequence[keras.layers.Layer]],
               schedule: schedule_lib.Schedule,
               device_grid: Sequence[Sequence[str]], num_microbatches: int,
               global_batch_size: int, recompute: str = "never"):
    """Prepares the per-stage forward functions and the clocks.

    Args:
      stage_layers: the model's layers, cut into K stages.
      schedule: per-stage action lists (see `schedule.py`).
      device_grid: device_grid[r][k] runs stage k of replica r; replica 0's
        devices hold the variables.
      num_microbatches: M, per replica.
      global_batch_size: examples per step over all replicas (the loss is
        scaled by it).
      recompute: "never", "always" or "except_last".
    """
    self.stage_layers = [list(s) for s in stage_layers]
    self.num_stages = len(self.stage_layers)
    self.schedule = schedule
    self.order = schedule_lib.execution_order(schedule)
    self.device_grid = [list(row) for row in device_grid]
    self.num_replicas = len(self.device_grid)
    self.num_microbatches = num_microbatches
    self.global_batch_size = global_batch_size
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
      fn = self._stage_fn(k)
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

  def _stage_fn(self, k):
    layers = self.stage_layers[k]

    def forward(x):
      for layer in layers:
        x = layer(x, training=True)
      return x

    return forward

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
      loss, correct: the global-batch mean loss and number of correct
        predictions.
      starts, ends: float64 [R, K, 2M] timestamps (seconds) of each stage's
        actions, in the stage's schedule order.
    """
    r_total, k_total, m = (self.num_replicas, self.num_stages,
                           self.num_microbatches)
    # Global batch -> R replica shards -> M micro-batches, contiguous, like
    # the sync mode's replica shards; chunk r*M + i is micro-batch i of r.
    xs = tf.split(x, r_total * m)
    ys = tf.split(y, r_total * m)
    losses, corrects = [], []
    accum = [[None] * k_total for _ in range(r_total)]
    starts = [[[] for _ in range(k_total)] for _ in range(r_total)]
    ends = [[[] for _ in range(k_total)] for _ in range(r_total)]
    for r in range(r_total):
      last_op = [[] for _ in range(k_total)]  # Per stage: the previous action.
      outputs = {}  # (k, "F"/"B", i) -> tensor sent on.
      tapes = {}    # (k, i) -> (tape, input, output) awaiting B i.
      for k, action in self.order:
        device = self.device_grid[r][k]
        i = action.microbatch
        last = k == k_total - 1
        if action.kind == schedule_lib.FORWARD:
          inp = xs[r * m + i] if k == 0 else outputs[(k - 1, "F", i)]
        else:
          inp = None if last else outputs[(k + 1, "B", i)]
        with tf.device(device):
          with tf.control_dependencies(
              last_op[k] + ([inp] if inp is not None else [])):
            t0 = self._stamp(r, k)
          with tf.control_dependencies([t0]):
            if action.kind == schedule_lib.FORWARD:
              done = self._forward_action(r, k, i, inp, ys, tapes, outputs,
                                          losses, corrects, loss_scale)
            else:
              done = self._backward_action(r, k, i, inp, tapes, outputs,
                                           accum)
          with tf.control_dependencies(done):
            t1 = self._stamp(r, k)
        last_op[k] = [t1]
        starts[r][k].append(t0)
        ends[r][k].append(t1)
    grads = self._reduce(accum)
    return {"grads": grads, "loss": tf.add_n(losses),
            "correct": tf.add_n(corrects),
            "starts": tf.stack([[tf.stack(s) for s in row] for row in starts]),
            "ends": tf.stack([[tf.stack(e) for e in row] for row in ends])}

  def _forward_action(self, r, k, i, inp, ys, tapes, outputs, losses,
                      corrects, loss_scale):
    """F i on stage k of replica r; returns the tensors that end it.

    On the last stage the tape's target, where B i starts, is the loss times
    `loss_scale` if given; `losses` gets the unscaled loss either way."""
    last = k == self.num_stages - 1
    inp = tf.identity(inp)  # The received copy, on this device.
    with tf.GradientTape() as tape:
      tape.watch(inp)
      out = self._forward[k](inp)
      if last:
        labels = ys[r * self.num_microbatches + i]
        out = tf.cast(out, tf.float32)  # The loss in float32 (mixed precision).
        per_example = keras.losses.sparse_categorical_crossentropy(
            labels, out, from_logits=True)
        loss = tf.reduce_sum(per_example) / self.global_batch_size
        target = loss if loss_scale is None else loss * loss_scale
    if last:
      correct = tf.reduce_sum(tf.cast(tf.equal(
          tf.argmax(out, -1, output_type=tf.int32),
          tf.cast(labels, tf.int32)), tf.float32))
      losses.append(loss)
      corrects.append(correct)
      tapes[(k, i)] = (tape, inp, target)
      return [target, correct]
    tapes[(k, i)] = (tape, inp, out)
    outputs[(k, "F", i)] = out
    return [out]

  def _backward_action(self, r, k, i, grad_out, tapes, outputs, accum):
    """B i on stage k of replica r; returns the tensors that end it."""
    tape, inp, out = tapes.pop((k, i))
    variables = self.stage_variables[k]
    sources = [inp] + variables
    grads = tape.gradient(out, sources, output_gradients=grad_out,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    if k > 0:
      outputs[(k, "B", i)] = grads[0]
    var_grads = [tf.convert_to_tensor(g) for g in grads[1:]]
    if accum[r][k] is None:
      accum[r][k] = var_grads
    else:
      accum[r][k] = [a + g for a, g in zip(accum[r][k], var_grads)]
    return ([grads[0]] if k > 0 else []) + accum[r][k]

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
