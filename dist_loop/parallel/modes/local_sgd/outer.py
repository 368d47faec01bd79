"""The synchronisation of local SGD: the outer step, and what it sends.

At a synchronisation each replica hands the all-reduce its pseudo-gradient,
the synchronised weights minus its own, and the mean of those is the outer
optimizer's gradient: an SGD step of learning rate 1 on it lands on the mean
of the replicas' weights (model averaging), and Nesterov momentum on it is
DiLoCo's outer step (Douillard et al. 2023, arXiv 2311.08105).
"""

from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from dist_loop.parallel.modes.local_sgd.options import LocalSGDOptions
from dist_loop.training import optim
from dist_loop.training import replicas


def make(options: LocalSGDOptions, variables: Sequence
         ) -> keras.optimizers.Optimizer:
  """The outer optimizer over the synchronised `variables`, built (call under
  the strategy's scope so its slots are mirrored)."""
  if options.outer_optimizer == "nesterov":
    optimizer = keras.optimizers.SGD(options.outer_learning_rate,
                                     momentum=options.outer_momentum,
                                     nesterov=True)
  else:
    optimizer = keras.optimizers.SGD(options.outer_learning_rate)
  optimizer.build(list(variables))
  return optimizer


def synchronise(synced_model, replica_model, optimizer) -> tf.Tensor:
  """One synchronisation, in replica context (inside `strategy.run`).

  All-reduces the mean pseudo-gradient and lets `optimizer` apply it to
  `synced_model`, alike on every replica; averages the non-trainable float
  weights (batch-norm statistics) into both models; and restarts every
  replica's `replica_model` from the new synchronised weights.

  Returns:
    The norm of the mean pseudo-gradient.
  """
  ctx = tf.distribute.get_replica_context()
  synced = synced_model.trainable_variables
  pseudo = [tf.convert_to_tensor(s) - tf.convert_to_tensor(r)
            for s, r in zip(synced, replica_model.trainable_variables)]
  mean = ctx.all_reduce(tf.distribute.ReduceOp.MEAN, pseudo)
  done = optim.apply_reduced(optimizer, mean, synced, tf.constant(True))
  pairs = _float_non_trainable(synced_model, replica_model)
  if pairs:
    averaged = ctx.all_reduce(tf.distribute.ReduceOp.MEAN,
                              [tf.convert_to_tensor(r) for _, r in pairs])
    replicas.write([s for s, _ in pairs], averaged)
    replicas.write([r for _, r in pairs], averaged)
  with tf.control_dependencies([done]):
    fresh = [tf.identity(tf.convert_to_tensor(v)) for v in synced]
  replicas.write(replica_model.trainable_variables, fresh)
  return tf.linalg.global_norm(mean)


def bytes_per_sync(model) -> int:
  """Bytes each replica hands to the all-reduces of one synchronisation."""
  variables = list(model.trainable_variables) + [
      v for v in model.non_trainable_weights if _is_float(v)]
  return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
             for v in variables)


def _float_non_trainable(synced_model, replica_model):
  return [(s, r) for s, r in zip(synced_model.non_trainable_weights,
                                 replica_model.non_trainable_weights)
          if _is_float(r)]


def _is_float(v) -> bool:
  return tf.as_dtype(v.dtype).is_floating
