"""Staleness policies of the async applier: small functions in registries.

The staleness bound (`--max_staleness`) is shared with the ps mode and lives
in `dist_loop/parallel/staleness.py`. Two more knobs, of the async mode only,
decide how a gradient of staleness tau that passed the bound is applied:

* `--staleness_lr=NAME` (`STALENESS_LR`): `fn(tau) -> scale`, the factor on
  the learning rate of this one update: the schedule's rate at the step the
  update makes (`--lr_schedule`, a function of the applied-update count),
  times `fn(tau)`. A Python function of a Python int,
  so a policy can be printed, tested and plotted without TensorFlow.
* `--async_compensation=NAME` (`COMPENSATIONS`):
  `fn(grads, now, read, dc_lambda) -> grads`, run inside the applier's
  `tf.function` on the master device; `now` are the master weights, `read`
  the weights the worker computed the gradient on.

An extension adds a policy with one registration, e.g.

    @STALENESS_LR.register("exp")
    def exp_decay(tau): return 0.5 ** tau

and selects it with `--staleness_lr=exp`.
"""

from typing import List, Sequence

import tensorflow as tf

from dist_loop.core.registry import Registry

STALENESS_LR: Registry = Registry("staleness learning-rate rule",
                                  "staleness_lr")
COMPENSATIONS: Registry = Registry("delay compensation", "async_compensation")


@STALENESS_LR.register("none")
def constant(tau: int) -> float:
  """Every gradient gets the full learning rate."""
  del tau
  return 1.0


@STALENESS_LR.register("inverse")
def inverse(tau: int) -> float:
  """lr / max(1, tau): staleness-aware async SGD (Zhang et al., 2016)."""
  return 1.0 / max(1, tau)


@COMPENSATIONS.register("none")
def no_compensation(grads: Sequence[tf.Tensor], now, read,
                    dc_lambda: float) -> List[tf.Tensor]:
  """The stale gradient as it is."""
  del now, read, dc_lambda
  return list(grads)


@COMPENSATIONS.register("dc")
def delay_compensation(grads: Sequence[tf.Tensor], now: Sequence[tf.Tensor],
                       read: Sequence[tf.Tensor],
                       dc_lambda: float) -> List[tf.Tensor]:
  """DC-ASGD (Zheng et al., 2017): g + lambda * g * g * (w_now - w_read).

  The first-order Taylor correction of g(w_read) towards g(w_now), with the
  Hessian approximated by lambda * g (outer) g, kept diagonal.
  """
  return [g + dc_lambda * g * g * (w - r) for g, w, r in zip(grads, now, read)]
