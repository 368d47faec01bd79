"""Optimizers (a name registry) and applying already-reduced gradients.

Why not `optimizer.apply`: a Keras 3 optimizer called in replica context
all-reduces (SUM) the gradients itself, so after our explicit all-reduce it
would count them twice; called in cross-replica context it fails. So the
update is done the way Keras does it internally, but without the reduce:
from replica context, `merge_call` into cross-replica context, then
`strategy.extended.update(var, fn)` runs the optimizer's `update_step` on each
device's copy of each variable, and the iteration counter moves once.
Outside any strategy (the default strategy) the same code applies directly.

A step whose gradients are not finite is not applied (`ok`). Where `ok` is
the same on every replica, one `tf.cond` holds the whole update. A cond per
variable and device copy, as Keras writes it, is cheap to run but slow to
trace: the sharding and Transformer tests took 88 s of CPU with it and 77 s
with one (one run each). Local SGD's replicas each decide for themselves
(`per_replica_ok`).

What every variable's update computes alike is computed once per device
copy and dtype (`_Rates`): the rate, and for Adam its step size (the rate
with its bias corrections) and constants, which Keras's `Adam.update_step`
makes for each variable in 18 of the 36 ops it traces for it. For Adam
and AdamW the rest of Keras's update is applied per variable with them
(`_adam_update`, op for op Keras's, so the values are the same to the
bit): a smaller graph to trace at every start, and to optimise.

The recipe (`Recipe`): every mode takes the update's rate from the run's
schedule (`schedules.py`) as a function of the step, and passes it here; the
optimizer's own `_learning_rate` variable is only written (so a checkpoint
shows the rate of its last update), never read, so a restore cannot put an
old rate back. Global-norm clipping (`clip_by_global_norm`) scales the
reduced gradient where a mode knows its norm: after the all-reduce (sync,
pipeline), after the scalar all-reduce of the shards' squared norms
(`--shard`), per inner step on each replica's own gradient (local SGD), per
push on the master (async, ps). Weight decay (`make`) is decoupled, as in
AdamW: `w -= lr * wd * w` before the optimizer's update, at the update's
(scheduled) rate, skipping variables of rank < 2.
"""

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import keras
import tensorflow as tf
from keras import ops

from dist_loop.core.registry import Registry
from dist_loop.runtime import strategy as strategy_lib
from dist_loop.training import schedules

OPTIMIZERS: Registry = Registry("optimizer", "optimizer")


@OPTIMIZERS.register("sgd")
def sgd(learning_rate):
  return keras.optimizers.SGD(learning_rate)


@OPTIMIZERS.register("momentum")
def momentum(learning_rate):
  return keras.optimizers.SGD(learning_rate, momentum=0.9)


@OPTIMIZERS.register("adam")
def adam(learning_rate):
  return keras.optimizers.Adam(learning_rate)


@OPTIMIZERS.register("adamw")
def adamw(learning_rate):
  return keras.optimizers.AdamW(learning_rate)


@OPTIMIZERS.register("rmsprop")
def rmsprop(learning_rate):
  return keras.optimizers.RMSprop(learning_rate)


# Optimizers whose update of each element depends only on that element's
# weight, gradient and slots (and on scalars): the update of a slice is the
# slice of the update, so a sharded run (`--shard`) may apply it shard by
# shard. An extension optimizer opts in with `fn.elementwise = True`.
for _fn in (sgd, momentum, adam, adamw, rmsprop):
  _fn.elementwise = True


def is_elementwise(name: str) -> bool:
  return bool(getattr(OPTIMIZERS.get(name), "elementwise", False))


def elementwise_names():
  return [n for n in OPTIMIZERS.names() if is_elementwise(n)]


def make(name: str, learning_rate: float, variables: Sequence[tf.Variable],
         weight_decay: float = -1.0,
         decayed: Optional[Sequence[bool]] = None
         ) -> keras.optimizers.Optimizer:
  """Builds the named optimizer and its slots for `variables`.

  Call under the strategy's scope, so the slots are mirrored like the model.

  Args:
    name: a registered optimizer.
    learning_rate: the initial value of its rate variable (every update
      passes its own rate to `apply_reduced`).
    variables: what it updates.
    weight_decay: decoupled weight decay (`--weight_decay`); -1: the
      optimizer's own (Keras: AdamW's 0.004 on every variable).
    decayed: per variable, whether it decays; default: rank >= 2 (not
      biases, nor normalisation scales and offsets). A sharded run passes
      its model variables' (its own variables are flat shards).
  """
  optimizer = OPTIMIZERS.get(name)(learning_rate)
  variables = list(variables)
  if weight_decay >= 0.0:
    if decayed is None:
      decayed = [len(v.shape) >= 2 for v in variables]
    optimizer.weight_decay = weight_decay or None
    optimizer.exclude_from_weight_decay(
        var_list=[v for v, d in zip(variables, decayed) if not d])
  optimizer.build(variables)
  return optimizer


class Recipe:
  """The update's rate and clipping, from the config; every mode applies
  it between its reduced gradient and `apply_reduced`.

  Args:
    config: the run's `Config` (`lr_schedule` and its options,
      `warmup_steps`, `learning_rate`, `clip_global_norm`).
  """

  CLIPPED = "clipped_fraction"  # A mean over updates: 1 if clipped, else 0.

  def __init__(self, config):
    self.schedule = schedules.make(config)
    self.clip_norm = config.clip_global_norm

  def rate(self, step) -> tf.Tensor:
    """The float32 rate of the update that moves the step counter from
    `step` (a value read before the update) to `step + 1`."""
    return self.schedule.rate(tf.cast(step, tf.int64) + 1)

  @property
  def mean_keys(self) -> Tuple[str, ...]:
    """The keys `clip` adds to a step's means."""
    return (self.CLIPPED,) if self.clip_norm else ()

  def clip(self, grads: Sequence[tf.Tensor], norm: tf.Tensor
           ) -> Tuple[List[tf.Tensor], Dict[str, tf.Tensor]]:
    """`clip_by_global_norm` at `--clip_global_norm`; returns (grads,
    {CLIPPED: 1.0 or 0.0}), or the gradients and {} without clipping."""
    if not self.clip_norm:
      return list(grads), {}
    grads, clipped = clip_by_global_norm(grads, norm, self.clip_norm)
    return grads, {self.CLIPPED: tf.cast(clipped, tf.float32)}


def clip_by_global_norm(grads: Sequence[tf.Tensor], norm: tf.Tensor,
                        clip_norm: float):
  """The gradients scaled by clip_norm / max(norm, clip_norm).

  `norm` is the global norm of the whole reduced gradient, computed by the
  caller (a sharded step holds only a shard of it). A gradient within the
  bound is multiplied by exactly 1. A non-finite norm makes every gradient
  non-finite, so the step is not applied, as without clipping.

  Returns:
    (gradients, clipped: whether the norm was above clip_norm).
  """
  norm = tf.cast(norm, tf.float32)
  factor = clip_norm / tf.maximum(norm, clip_norm)
  return [g * tf.cast(factor, g.dtype) for g in grads], norm > clip_norm


def all_finite(grads: Sequence[tf.Tensor]) -> tf.Tensor:
  """Whether every gradient is free of NaN and Inf: the `ok` of a step."""
  return tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])


def apply_reduced(optimizer: keras.optimizers.Optimizer,
                  grads: Sequence[tf.Tensor], variables: Sequence,
                  ok: tf.Tensor, lr_scale=None,
                  per_replica_ok: bool = False,
                  learning_rate: Optional[tf.Tensor] = None) -> tf.Tensor:
  """Applies gradients that were already all-reduced, once, if `ok`.

  Call in replica context (inside `strategy.run`), outside any strategy, or
  in cross-replica context with gradients that are not per-replica (the ps
  mode, whose one replica per worker has already returned them).

  Args:
    optimizer: a built Keras 3 optimizer.
    grads: the reduced gradients, one per variable.
    variables: the model's (Keras) variables.
    ok: a boolean scalar, equal on every replica; False skips the update,
      slots and iteration counter included.
    lr_scale: optional float32 scalar; this update uses the learning rate
      times it (the async mode's staleness policies). None: the plain rate.
    per_replica_ok: each replica has its own `ok` and applies its own
      update, or not (local SGD's replicas, whose copies differ).
    learning_rate: the float32 rate of this update (`Recipe.rate`),
      written into the optimizer's rate variable; None: that variable's
      value (local SGD's outer optimizer, which has no schedule).

  Returns:
    `ok`, available only once every update has run, so callers can order
    work after the update (the ps mode's lock is released after it).
  """
  kwargs = {} if lr_scale is None else {"lr_scale": lr_scale}
  if learning_rate is not None:
    kwargs["learning_rate"] = learning_rate
  done = strategy_lib.cross_replica_call(
      _update, optimizer, list(grads), [_tf_variable(v) for v in variables],
      ok, per_replica_ok=per_replica_ok, **kwargs)
  with tf.control_dependencies(done):
    return tf.identity(ok)


def _update(strategy, optimizer, grads, variables, ok, lr_scale=None,
            per_replica_ok=False, learning_rate=None):
  """Cross-replica half of `apply_reduced`: one update per device copy.
  Decoupled weight decay (AdamW) comes first, as in Keras's `apply`."""
  wd = getattr(optimizer, "weight_decay", None)
  rates = _Rates(optimizer, lr_scale)

  def update_for(var):
    decay = wd is not None and optimizer._use_weight_decay(var)  # pylint: disable=protected-access

    def update(copy, grad, lr, step_lr, adam):
      if decay:
        copy.assign_sub(copy * tf.cast(wd, copy.dtype) * lr)
      if adam is None:
        optimizer.update_step(grad, copy, step_lr)
      else:
        _adam_update(optimizer, grad, copy, adam)
      return tf.constant(True)

    def update_if(copy, grad, apply, *rate):
      # The shared values before the cond: one branch cannot use another's.
      shared = rates(copy, rate)
      return tf.cond(apply, lambda: update(copy, grad, *shared),
                     lambda: tf.constant(False))

    return (update_if if per_replica_ok else
            lambda copy, grad, *rate: update(copy, grad, *rates(copy, rate)))

  rate = () if learning_rate is None else (learning_rate,)

  def update_all():
    extra = (ok,) if per_replica_ok else ()
    return _local_results(strategy, [
        strategy.extended.update(var, update_for(var),
                                 args=(grad, *extra, *rate), group=False)
        for grad, var in zip(grads, variables)])

  def applied():
    with tf.control_dependencies(update_all()):
      return tf.constant(True)

  if per_replica_ok:
    done = update_all()
  else:  # One decision for every variable and copy: the first replica's.
    ok = strategy.experimental_local_results(ok)[0]
    done = [tf.cond(ok, applied, lambda: tf.constant(False))]
  done += _local_results(strategy, [strategy.extended.update(
      _tf_variable(optimizer.iterations),
      lambda it, apply: it.assign_add(tf.cast(apply, it.dtype)).read_value(),
      args=(ok,), group=False)])
  if rate:  # What a checkpoint shows; never read back (module docstring).
    rate_variable = _tf_variable(optimizer._learning_rate)  # pylint: disable=protected-access
    done += _local_results(strategy, [strategy.extended.update(
        rate_variable, lambda v, r: v.assign(r).read_value(), args=rate,
        group=False)])
  return done


class _Rates:
  """What an update computes alike for every variable, once per device copy,
  dtype and graph (a `tf.cond` branch cannot use another's values): the
  rate cast to the dtype, the rate times `lr_scale`, and for Adam its step
  size (module docstring)."""

  def __init__(self, optimizer, lr_scale):
    self._optimizer = optimizer
    self._lr_scale = lr_scale
    self._adam = _plain_adam(optimizer)
    self._cache = {}

  def __call__(self, copy, rate):
    """(rate, the update's rate, Adam's `_AdamShared` or None) for `copy`, a
    device copy of a variable; `rate` is () or (the update's rate,)."""
    key = (tf.compat.v1.get_default_graph(), copy.device, copy.dtype)
    if key not in self._cache:
      lr = tf.cast(rate[0] if rate else self._optimizer.learning_rate,
                   copy.dtype)
      step_lr = lr
      if self._lr_scale is not None:
        step_lr = lr * tf.cast(self._lr_scale, copy.dtype)
      adam = (_adam_shared(self._optimizer, step_lr, copy.dtype)
              if self._adam else None)
      self._cache[key] = lr, step_lr, adam
    return self._cache[key]


def _plain_adam(optimizer) -> bool:
  """Whether `optimizer` updates as Keras's Adam does (Adam, AdamW: its
  `update_step`, without AMSGrad), so `_adam_update` may apply it."""
  return (isinstance(optimizer, keras.optimizers.Adam)
          and type(optimizer).update_step is keras.optimizers.Adam.update_step
          and not optimizer.amsgrad)


# Keras's `Adam.update_step`, cut in two: what is the same for every
# variable of a dtype on a device (the step size, and the constants Keras
# converts from Python floats again for each variable), and the update of
# one variable with it. Op for op what Keras writes, the constants shared
# (`tests/test_optim.py` checks the updates are equal to the bit).
class _AdamShared(NamedTuple):
  step_size: tf.Tensor
  one_minus_beta_1: tf.Tensor
  one_minus_beta_2: tf.Tensor
  epsilon: tf.Tensor


def _adam_shared(optimizer, learning_rate, dtype) -> _AdamShared:
  lr = ops.cast(learning_rate, dtype)
  local_step = ops.cast(optimizer.iterations + 1, dtype)
  beta_1_power = ops.power(ops.cast(optimizer.beta_1, dtype), local_step)
  beta_2_power = ops.power(ops.cast(optimizer.beta_2, dtype), local_step)
  step_size = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
  # As `ops.multiply(x, 1 - beta_1)` converts its float for an x of dtype.
  return _AdamShared(step_size, *(
      tf.convert_to_tensor(value, dtype) for value in (
          1 - optimizer.beta_1, 1 - optimizer.beta_2, optimizer.epsilon)))


def _adam_update(optimizer, gradient, variable, shared: _AdamShared):
  gradient = ops.cast(gradient, variable.dtype)
  index = optimizer._get_variable_index(variable)  # pylint: disable=protected-access
  m = optimizer._momentums[index]  # pylint: disable=protected-access
  v = optimizer._velocities[index]  # pylint: disable=protected-access
  optimizer.assign_add(
      m, ops.multiply(ops.subtract(gradient, m), shared.one_minus_beta_1))
  optimizer.assign_add(
      v, ops.multiply(ops.subtract(ops.square(gradient), v),
                      shared.one_minus_beta_2))
  optimizer.assign_sub(
      variable, ops.divide(ops.multiply(m, shared.step_size),
                           ops.add(ops.sqrt(v), shared.epsilon)))


def _local_results(strategy, results) -> List[tf.Tensor]:
  """Plain tensors: strategies wrap each result (a 1-tuple, or a mirrored
  value), and a control dependency on a wrapper silently adds no edge."""
  return [t for result in tf.nest.flatten(results)
          for t in strategy.experimental_local_results(result)]


def _tf_variable(v):
  """A Keras 3 variable's backing tf.Variable (mirrored under a strategy)."""
  return getattr(v, "value", v) if isinstance(v, keras.Variable) else v
