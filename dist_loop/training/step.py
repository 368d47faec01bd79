"""The step core: what every mode computes for a batch, written once.

Every mode splits an update's batch among *contributors*: the replicas of a
synchronous step, the micro-batches of a pipeline or of gradient
accumulation, or one worker of an asynchronous mode that sends a whole
update. Each contributor differentiates its *share* of the update's mean
loss, and the mode sums the shares' gradients in its own way (an all-reduce,
an accumulator, or nothing). Two rules make every mode equal to
single-device training:

1. A contributor's share of a mean is its sum over its predictions divided
   by the predictions of the whole update (`examples_per_update` examples).
2. Regularisation (`model.losses`, a per-update term) is split evenly: each
   contributor adds 1/`contributors` of it, so the shares add up to the
   single-device loss.

The loop base (`modes/loop.py`) keeps a loop's metrics: each replica sums
its own steps' values in the traced loop (`zero_sums`, `add_step`), one
gather brings every replica's row (`sums_row`) to the host once per loop,
and `LoopSums` turns the rows into means over the applied steps.
`above_bound` is the divergence guard (`--max_loss`) of every mode.
"""

from typing import Dict, Optional, Sequence

import numpy as np
import tensorflow as tf

from dist_loop.tasks import Task


def shares(task: Task, logits, labels, *, examples_per_update: int,
           regularization: Optional[Sequence[tf.Tensor]] = None,
           contributors: int = 1) -> Dict[str, tf.Tensor]:
  """One contributor's share of an update's mean loss and metrics.

  Args:
    task: what is learned.
    logits, labels: the contributor's part of the update's batch.
    examples_per_update: examples in the whole update (all contributors).
    regularization: the model's regularisation terms (`model.losses`).
    contributors: how many shares make the update.

  Returns:
    {name: share} for each of `task.metric_names`; `loss` includes the
    share of regularisation and is what a contributor differentiates.
  """
  sums = task.sums(logits, labels)
  predictions = examples_per_update * task.predictions_per_example(labels)
  out = {k: sums[k] / predictions for k in task.metric_names}
  if regularization:
    penalty = tf.cast(tf.add_n(list(regularization)), tf.float32)
    out["loss"] += penalty / contributors
  return out


def gradients(task: Task, model, x, y, *, examples_per_update: int,
              contributors: int = 1, scale: Optional[tf.Tensor] = None,
              training: bool = True,
              weights: Optional[Sequence[tf.Tensor]] = None):
  """A contributor's share (see `shares`) and the gradients of its loss.

  Args:
    task, examples_per_update, contributors: as in `shares`.
    model: the model; its `losses` are the regularisation.
    x, y: the contributor's part of the update's batch.
    scale: float16 loss scaling: the gradients are of loss x `scale`.
    training: the model's training mode (False to probe the gradients).
    weights: values to run the model on instead of its trainable
      variables (`model.stateless_call`: sharded weights gathered for the
      step); the gradients are then with respect to them. The model must
      have no non-trainable state.

  Returns:
    (shares, gradients), a gradient per `model.trainable_variables`.
  """
  with tf.GradientTape() as tape:
    if weights is None:
      logits, regularization = model(x, training=training), model.losses
      sources = model.trainable_variables
    else:
      tape.watch(weights)
      logits, _, regularization = model.stateless_call(
          list(weights), [], x, training=training, return_losses=True)
      sources = list(weights)
    out = shares(task, logits, y, examples_per_update=examples_per_update,
                 regularization=regularization, contributors=contributors)
    objective = out["loss"] if scale is None else out["loss"] * scale
  return out, tape.gradient(objective, sources)


def accumulated_gradients(task: Task, model, x, y, *, chunks: int,
                          examples_per_update: int, contributors: int = 1,
                          scale: Optional[tf.Tensor] = None,
                          weights: Optional[Sequence[tf.Tensor]] = None):
  """`gradients` of `chunks` equal micro-batches of (x, y), summed.

  The micro-batches run one after the other, so only one micro-batch of
  activations is alive at a time. `contributors` counts every micro-batch
  of the update (e.g. replicas x chunks); `weights` as in `gradients`.
  The last micro-batch runs after
  the loop over the others, so each of its gradients is summed (and can
  start its all-reduce) as soon as the backward pass reaches it.
  """
  kwargs = dict(examples_per_update=examples_per_update,
                contributors=contributors, scale=scale, weights=weights)
  if chunks == 1:
    return gradients(task, model, x, y, **kwargs)
  xs = tf.reshape(x, tf.concat([[chunks, -1], tf.shape(x)[1:]], 0))
  ys = tf.reshape(y, tf.concat([[chunks, -1], tf.shape(y)[1:]], 0))

  def add(i, out, grads):
    o, g = gradients(task, model, xs[i], ys[i], **kwargs)
    return (i + 1, {k: out[k] + o[k] for k in out},
            [a + b for a, b in zip(grads, g)])

  out, grads = gradients(task, model, xs[0], ys[0], **kwargs)
  if chunks > 2:  # Micro-batches 1 .. chunks - 2, in a loop.
    _, out, grads = tf.while_loop(lambda i, *_: i < chunks - 1, add,
                                  (tf.constant(1), out, grads))
  o, g = gradients(task, model, xs[chunks - 1], ys[chunks - 1], **kwargs)
  return ({k: out[k] + o[k] for k in out},
          [a + b for a, b in zip(grads, g)])


def above_bound(loss: tf.Tensor, max_loss: float):
  """The divergence guard of every mode (`--max_loss`): whether a finite
  loss is above `max_loss`. Python False without a bound (0), so a run
  without one traces no extra op. A non-finite loss is the non-finite
  policy's, not this."""
  if not max_loss:
    return False
  loss = tf.cast(loss, tf.float32)
  return tf.math.is_finite(loss) & (loss > max_loss)


# -- A loop's sums, per replica (the loop base) --

# The counts that follow the sums in a replica's row (`sums_row`).
COUNTS = ("applied", "skipped", "skipped_at_end", "first_bad")
NO_STEP = 2**53  # "No bad step": beyond any step, exact in float64.


def zero_sums(keys: Sequence[str]) -> Dict[str, tf.Tensor]:
  """A replica's sums before a loop's first step (traced)."""
  sums = {k: tf.constant(0.0) for k in keys}
  zero = tf.constant(0.0, tf.float64)
  sums.update(applied=zero, skipped=zero, skipped_at_end=zero,
              first_bad=tf.constant(float(NO_STEP), tf.float64))
  return sums


def add_step(sums, values, *, applied, loss_ok, may_skip: bool,
             skip_all: bool, step) -> Dict[str, tf.Tensor]:
  """A replica's `sums` after one more step (traced).

  Args:
    sums: from `zero_sums`, or the previous step.
    values: the step's float32 value of every key of `sums` but the counts.
    applied: bool tensor: the step's update was applied.
    loss_ok: bool tensor: this replica's loss was finite.
    may_skip: a step not applied is skipped, not bad (`--nonfinite=skip`,
      or a float16 loss scale).
    skip_all: `--nonfinite=skip`: a non-finite loss is skipped too.
    step: the step's number (after it ran).

  Returns:
    The sums with the step's values added if it counts (applied, with a
    finite loss); a skipped step counted, and among `skipped_at_end`
    (reset by an applied one); a bad step's number kept in `first_bad`.
  """
  counted = tf.logical_and(applied, loss_ok)
  new = {k: tf.where(counted, sums[k] + values[k], sums[k])
         for k in sums if k not in COUNTS}
  new["applied"] = sums["applied"] + tf.cast(counted, tf.float64)
  skipped = tf.cast(tf.logical_and(tf.logical_not(applied), may_skip),
                    tf.float64)
  new["skipped"] = sums["skipped"] + skipped
  new["skipped_at_end"] = tf.where(applied, tf.constant(0.0, tf.float64),
                                   sums["skipped_at_end"] + skipped)
  bad = tf.logical_or(
      tf.logical_and(tf.logical_not(applied), not may_skip),
      tf.logical_and(tf.logical_not(loss_ok), not skip_all))
  new["first_bad"] = tf.where(
      bad, tf.minimum(sums["first_bad"], tf.cast(step, tf.float64)),
      sums["first_bad"])
  return new


def sums_row(sums, keys: Sequence[str]) -> tf.Tensor:
  """A replica's sums as one float64 row [1, keys + COUNTS], to gather."""
  return tf.stack([tf.cast(sums[k], tf.float64) for k in keys]
                  + [sums[k] for k in COUNTS])[None]


class LoopSums:
  """Means over applied steps, from a loop's gathered rows, on the host.

  Built from the rows [replicas, keys + COUNTS] of one loop: each replica's
  sums are divided by the steps it counted, then shares are summed over
  replicas and means averaged. `add` merges the loops of a `train` call,
  weighting each mean by the applied steps of the loops that have it.

  Attributes:
    applied, skipped: steps counted (applied, finite loss) and skipped.
    skipped_at_end: skipped steps since the last applied one.
    first_bad: the first bad step of any replica, or NO_STEP.
  """

  def __init__(self, share_keys: Sequence[str] = (),
               mean_keys: Sequence[str] = (),
               rows: Optional[np.ndarray] = None):
    self._weighted: Dict[str, float] = {}  # Sum of mean x applied steps.
    self._weights: Dict[str, int] = {}  # Applied steps behind each sum.
    self.applied = self.skipped = self.skipped_at_end = 0
    self.first_bad = NO_STEP
    if rows is None:
      return
    share_keys, keys = tuple(share_keys), tuple(share_keys) + tuple(mean_keys)
    counts = dict(zip(COUNTS, rows[:, len(keys):].T))
    counted = counts["applied"]
    self.applied = int(counted[0])
    self.skipped = int(counts["skipped"][0])
    self.skipped_at_end = int(counts["skipped_at_end"][0])
    self.first_bad = int(counts["first_bad"].min())
    if not self.applied:
      return
    per_step = rows[:, :len(keys)] / np.maximum(counted, 1)[:, None]
    n = len(share_keys)
    means = dict(zip(share_keys, per_step[:, :n].sum(axis=0)))
    means.update(zip(keys[n:], per_step[:, n:].mean(axis=0)))
    for k, v in means.items():
      self._weighted[k] = float(v) * self.applied
      self._weights[k] = self.applied

  def add(self, other: "LoopSums", keys: Sequence[str]) -> None:
    """Adds a later loop's `keys` (those it has) and counts."""
    for k in keys:
      if k in other._weights:  # pylint: disable=protected-access
        self._weighted[k] = self._weighted.get(k, 0.0) + other._weighted[k]  # pylint: disable=protected-access
        self._weights[k] = self._weights.get(k, 0) + other._weights[k]  # pylint: disable=protected-access
    self.skipped_at_end = (other.skipped_at_end if other.applied
                           else self.skipped_at_end + other.skipped)
    self.applied += other.applied
    self.skipped += other.skipped
    self.first_bad = min(self.first_bad, other.first_bad)

  def means(self) -> Dict[str, float]:
    """Each value's mean over the applied steps; empty if no step was
    applied (a skipped step never reports a loss of 0)."""
    return {k: v / self._weights[k] for k, v in self._weighted.items()}
