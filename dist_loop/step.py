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

`run_steps` is the inner loop of the modes that apply one update per step
(sync and pipeline): the step counter, the non-finite policy and loss-scale
skips, the divergence guard (`--max_loss`), and the means of the metrics
over the loop.
"""

from typing import Callable, Dict, Optional, Sequence, Tuple

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
  out, grads = gradients(task, model, xs[0], ys[0], **kwargs)
  for i in tf.range(1, chunks - 1):
    o, g = gradients(task, model, xs[i], ys[i], **kwargs)
    out = {k: out[k] + o[k] for k in out}
    grads = [a + b for a, b in zip(grads, g)]
  o, g = gradients(task, model, xs[chunks - 1], ys[chunks - 1], **kwargs)
  return ({k: out[k] + o[k] for k in out},
          [a + b for a, b in zip(grads, g)])


StepFn = Callable[..., Tuple[Dict[str, tf.Tensor], tf.Tensor, object]]


def above_bound(loss: tf.Tensor, max_loss: float):
  """The divergence guard of every mode (`--max_loss`): whether a finite
  loss is above `max_loss`. Python False without a bound (0), so a run
  without one traces no extra op. A non-finite loss is the non-finite
  policy's, not this."""
  if not max_loss:
    return False
  loss = tf.cast(loss, tf.float32)
  return tf.math.is_finite(loss) & (loss > max_loss)


def run_steps(step_fn: StepFn, iterator, num_steps: tf.Tensor,
              step: tf.Variable, *, keys: Sequence[str], nonfinite: str,
              loss_scale=None, carry=(), max_loss: float = 0.0):
  """Runs `num_steps` steps of `step_fn` inside the caller's tf.function.

  Args:
    step_fn: `fn(batch) -> (metrics, ok, carry)`. `metrics` are the
      update's float32 scalars (at least `keys`, `loss` among them); `ok`
      says the update was applied (its gradients were finite); `carry` is
      any nest of tensors to keep from the last step that ran (the
      pipeline's timeline), with the structure of the `carry` argument.
    iterator: yields one update's batch per `next`.
    num_steps: int64 scalar tensor.
    step: the int64 step variable; advances once per step that ran,
      applied or skipped.
    keys: the metrics to average over the applied steps.
    nonfinite: the `--nonfinite` policy. "skip" skips any non-finite step;
      otherwise only a loss-scale overflow (with `loss_scale`) is skipped,
      and any other non-finite step ends the loop, not applied.
    loss_scale: the DynamicLossScale, or None.
    carry: the initial carry.
    max_loss: a step whose loss is above it ends the loop like a
      non-finite step, whatever `nonfinite` says (its update is already
      applied, so it cannot be skipped); 0: no bound.

  Returns:
    (means, bad_step, carry): the means over applied steps plus
    `skipped_steps` (and `loss_scale` if any); the step at which a
    non-finite (or diverged) step ended the loop, or -1.
  """
  skip_all = nonfinite == "skip"
  may_skip = skip_all or loss_scale is not None
  total = {k: tf.constant(0.0) for k in keys}
  done = tf.constant(0, tf.int64)
  skipped = tf.constant(0, tf.int64)
  bad_step = tf.constant(-1, tf.int64)
  for _ in tf.range(num_steps):
    metrics, ok, new_carry = step_fn(next(iterator))
    step.assign_add(1)
    loss_ok = tf.math.is_finite(metrics["loss"])
    diverged = above_bound(metrics["loss"], max_loss)
    if diverged or not (loss_ok or skip_all) or not (ok or may_skip):
      bad_step = step.read_value()
      break
    done += 1
    carry = new_carry
    if not (ok and loss_ok):
      skipped += 1
      continue
    total = {k: total[k] + metrics[k] for k in keys}
  n = tf.maximum(tf.cast(done - skipped, tf.float32), 1.0)
  means = {k: v / n for k, v in total.items()}
  means["skipped_steps"] = tf.cast(skipped, tf.float32)
  if loss_scale is not None:
    means["loss_scale"] = loss_scale.scale.read_value()
  return means, bad_step, carry
