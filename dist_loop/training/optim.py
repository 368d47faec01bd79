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
"""

from typing import List, Sequence

import keras
import tensorflow as tf

from dist_loop.core.registry import Registry
from dist_loop.runtime import strategy as strategy_lib

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


def make(name: str, learning_rate: float,
         variables: Sequence[tf.Variable]) -> keras.optimizers.Optimizer:
  """Builds the named optimizer and its slots for `variables`.

  Call under the strategy's scope, so the slots are mirrored like the model.
  """
  optimizer = OPTIMIZERS.get(name)(learning_rate)
  optimizer.build(list(variables))
  return optimizer


def all_finite(grads: Sequence[tf.Tensor]) -> tf.Tensor:
  """Whether every gradient is free of NaN and Inf: the `ok` of a step."""
  return tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])


def apply_reduced(optimizer: keras.optimizers.Optimizer,
                  grads: Sequence[tf.Tensor], variables: Sequence,
                  ok: tf.Tensor, lr_scale=None,
                  per_replica_ok: bool = False) -> tf.Tensor:
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

  Returns:
    `ok`, available only once every update has run, so callers can order
    work after the update (the ps mode's lock is released after it).
  """
  kwargs = {} if lr_scale is None else {"lr_scale": lr_scale}
  done = strategy_lib.cross_replica_call(
      _update, optimizer, list(grads), [_tf_variable(v) for v in variables],
      ok, per_replica_ok=per_replica_ok, **kwargs)
  with tf.control_dependencies(done):
    return tf.identity(ok)


def _update(strategy, optimizer, grads, variables, ok, lr_scale=None,
            per_replica_ok=False):
  """Cross-replica half of `apply_reduced`: one update per device copy.
  Decoupled weight decay (AdamW) comes first, as in Keras's `apply`."""
  wd = getattr(optimizer, "weight_decay", None)

  def update_for(var):
    decay = wd is not None and optimizer._use_weight_decay(var)  # pylint: disable=protected-access

    def update(copy, grad):
      lr = tf.cast(optimizer.learning_rate, copy.dtype)
      if decay:
        copy.assign_sub(copy * tf.cast(wd, copy.dtype) * lr)
      if lr_scale is not None:
        lr *= tf.cast(lr_scale, copy.dtype)
      optimizer.update_step(grad, copy, lr)
      return tf.constant(True)

    def update_if(copy, grad, apply):
      return tf.cond(apply, lambda: update(copy, grad),
                     lambda: tf.constant(False))

    return update_if if per_replica_ok else update

  def update_all():
    extra = (ok,) if per_replica_ok else ()
    return _local_results(strategy, [
        strategy.extended.update(var, update_for(var), args=(grad, *extra),
                                 group=False)
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
  return done


def _local_results(strategy, results) -> List[tf.Tensor]:
  """Plain tensors: strategies wrap each result (a 1-tuple, or a mirrored
  value), and a control dependency on a wrapper silently adds no edge."""
  return [t for result in tf.nest.flatten(results)
          for t in strategy.experimental_local_results(result)]


def _tf_variable(v):
  """A Keras 3 variable's backing tf.Variable (mirrored under a strategy)."""
  return getattr(v, "value", v) if isinstance(v, keras.Variable) else v
