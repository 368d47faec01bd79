"""Sharded data parallelism in sync mode (`--reducer=zero1|zero2|zero3`).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (2019). With N replicas and Psi parameters, Adam in
float32 holds 4 Psi of weights, 4 Psi of gradients and 8 Psi of slots on
every replica. Each stage divides one more of them by N:

* `optimizer` (stage 1): each replica keeps the slots of its shard of
  every variable (`layout.py`), and a float32 shard of the weights for the
  optimizer to update (ZeRO's fp32 master copy). After the usual
  all-reduce, each replica updates its shard; the updated shards are
  all-gathered into every replica's full weights.
* `gradients` (stage 2): each replica keeps only its shard of the reduced
  gradient (a reduce-scatter, `collectives.py`), so the gradient's norm and
  finiteness take one all-reduce of two scalars.
* `weights` (stage 3): the full weights are no longer kept on the devices:
  a step all-gathers them, in buckets, first layers first, runs the model
  on them (`model.stateless_call`, through the step core), and frees them
  when its backward pass is done. `model` is then a host copy for
  evaluation and checkpoints, refreshed by one all-gather per inner loop
  (`refresh`).

The update is the optimizer's own element-wise arithmetic on each shard,
so every stage equals unsharded sync (tests: to 1e-6). Only optimizers
whose update is element-wise may be sharded (`optim.is_elementwise`).
"""

from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from dist_loop.core.errors import UserError
from dist_loop.parallel.sharding import collectives
from dist_loop.parallel.sharding.state import ShardedState
from dist_loop.training import optim, replicas

STAGES = ("none", "optimizer", "gradients", "weights")
# Each stage's reducer (`dist_loop/parallel/reducers/sharded.py`).
REDUCERS = {"optimizer": "zero1", "gradients": "zero2", "weights": "zero3"}


def check(stage: str, optimizer: str) -> None:
  """What a ZeRO stage cannot be combined with. Raises UserError."""
  if not optim.is_elementwise(optimizer):
    raise UserError(
        f"--reducer={REDUCERS[stage]} needs an optimizer whose update is "
        f"element-wise, and --optimizer={optimizer} is not known to "
        f"be; use one of {', '.join(optim.elementwise_names())}, or "
        "--reducer=exact")


class Sharding:
  """The sharded part of a sync step, for one model.

  Args:
    stage: "optimizer", "gradients" or "weights".
    strategy: the run's strategy.
    model: the model; under "weights", its variables are a host copy.
    optimizer, learning_rate: the run's optimizer.
    bucket_mb: the all-gathers' bucket size (the all-reduce's own buckets
      are the compressor's).
    weight_decay: `--weight_decay` (`optim.make`).
  """

  def __init__(self, stage: str, strategy, model, optimizer: str,
               learning_rate: float, bucket_mb: float,
               weight_decay: float = -1.0):
    if stage == "weights" and model.non_trainable_variables:
      raise UserError(
          f"--reducer=zero3 runs the model on gathered weights, and the "
          f"model has non-trainable state "
          f"({model.non_trainable_variables[0].path}, ...) that would not "
          "follow; use --reducer=zero2")
    self.stage = stage
    self.strategy = strategy
    self.model = model
    self.state = ShardedState(strategy, model.trainable_variables, optimizer,
                              learning_rate, weight_decay)
    self.layout = self.state.layout
    self.bucket_elements = int(bucket_mb * 2**20) // 4
    self.forward = list(range(len(self.state.shards)))
    self._loaded = False
    self._refresh = tf.function(self._refresh_fn, autograph=False)

  @property
  def optimizer(self):
    """What the checkpoint and the learning-rate log read."""
    return self.state.checkpoint

  # -- before and after inner loops --

  def before_train(self) -> None:
    """Shards the model's weights (at the start, and after any restore:
    the checkpoint restores the full model) and restored slots."""
    if not self._loaded:
      self.state.load()
      self._loaded = True
    self.state.apply()

  def on_restore(self) -> None:
    self._loaded = False

  def refresh(self) -> None:
    """Stage 3: the host model from the shards (one all-gather)."""
    if self.stage == "weights":
      self._refresh()

  def _refresh_fn(self):
    def replica():
      return collectives.gather(self.layout, self._read_shards(),
                                self.forward, 0)
    values = self.strategy.run(replica)
    for var, value in zip(self.model.trainable_variables, values):
      var.assign(self.strategy.experimental_local_results(value)[0])

  # -- inside the step (replica context) --

  def weights(self) -> Optional[List[tf.Tensor]]:
    """Stage 3: the step's full weights, gathered first layers first."""
    if self.stage != "weights":
      return None
    return collectives.gather(self.layout, self._read_shards(), self.forward,
                              self.bucket_elements)

  def apply(self, grads: Sequence[tf.Tensor], reduce_fn, loss_scale,
            scale, recipe, step) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """Reduces this replica's gradients, clips them by the norm of the
    whole reduced gradient (`recipe`), updates its shards at the rate of
    the update after `step`, and (stages 1 and 2) gathers the updated
    weights into the model. Returns (ok, means: `grad_norm`, the unclipped
    norm, and the recipe's keys), the same on every replica."""
    ctx = tf.distribute.get_replica_context()
    replica = ctx.replica_id_in_sync_group
    if self.stage == "optimizer":
      reduced = reduce_fn(list(grads))
      if scale is not None:
        reduced = [g / scale for g in reduced]
      ok = optim.all_finite(reduced)
      norm = tf.linalg.global_norm(reduced)
      shards = [self.layout.shard(i, g, replica)
                for i, g in enumerate(reduced)]
    else:
      shards = collectives.reduce_scatter(self.layout, reduce_fn, grads,
                                          replica)
      if scale is not None:
        shards = [g / scale for g in shards]
      local = tf.stack([
          tf.add_n([tf.reduce_sum(tf.square(g)) for g in shards]),
          tf.add_n([tf.reduce_sum(tf.cast(~tf.math.is_finite(g), tf.float32))
                    for g in shards])])
      total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, local)
      ok, norm = tf.equal(total[1], 0.0), tf.sqrt(total[0])
    shards, means = recipe.clip(shards, norm)
    done = optim.apply_reduced(self.state.optimizer, shards,
                               self.state.shards, ok,
                               learning_rate=recipe.rate(step))
    if loss_scale is not None:
      loss_scale.update(ok)
    if self.stage != "weights":
      with tf.control_dependencies([done]):
        full = collectives.gather(self.layout, self._read_shards(),
                                  self.forward, self.bucket_elements)
      replicas.write(self.model.trainable_variables, full)
    return ok, {"grad_norm": norm, **means}

  def _read_shards(self) -> List[tf.Tensor]:
    return [tf.convert_to_tensor(replicas.backing(s))
            for s in self.state.shards]
