"""How a sync step's gradients become its update: one object per run.

`SyncTrainer` holds one path: its step computes each replica's gradients
through the step core and hands them to the run's `Reduction`, which
reduces them with the run's compressor (`--allreduce_compression`),
applies them, and returns whether it did and the norm of what it applied
(the same on every replica). Two reductions:

* `Replicated` (`--shard=none`): every replica holds the whole model and
  optimizer. A compressor with state (error feedback) keeps it per replica
  and writes it only when the step is applied; it is the checkpoint's
  `compression` entry, so without one the checkpoint holds what it always
  did. Such a compressor gets unscaled gradients (a residual outlives the
  loss scale it was computed under).
* `Sharded` (`--shard=optimizer|gradients|weights`): ZeRO's stages
  (`dist_loop/parallel/sharding/zero.py`), whose compressor is a (maybe cast)
  sum that the stage slices.

Each owns what it adds to the checkpoint, its work around an inner loop,
and its bytes and memory (`sharding/accounting.py`). A compressor's warm-up
(`exact_steps`) runs the exact sum (`exact=True`), which neither reads nor
moves the compressor's state.
"""

from typing import Dict, List, Optional

import tensorflow as tf

from dist_loop.parallel import compression
from dist_loop.parallel.sharding import accounting, collectives, zero
from dist_loop.training import optim
from dist_loop.training import precision as precision_lib


class Replicated:
  """`--shard=none`: the whole model and optimizer on every replica.

  Args:
    options: the run's `SyncOptions`.
    config: the run's `Config` (optimizer, learning rate, seed).
    strategy: the run's strategy.
    model: the model, its variables mirrored.
    loss_scale: the run's `DynamicLossScale`, or None.
  """

  def __init__(self, options, config, strategy, model, loss_scale, recipe):
    self.strategy, self.model, self.loss_scale = strategy, model, loss_scale
    self.recipe = recipe
    self.steps_per_loop = config.steps_per_loop
    variables = model.trainable_variables
    self.optimizer = self._make_optimizer(config)
    self.compressor = compression.make(options, variables, config.seed)
    self.exact = compression.COMPRESSORS.get("none")(options, variables)
    self.compression_state = compression.State(
        strategy, self.compressor.initial_state())

  @staticmethod
  def host_model(options) -> bool:
    """Whether the model is a host copy (else built on the devices)."""
    del options
    return False

  def _make_optimizer(self, config):
    with self.strategy.scope():
      return optim.make(config.optimizer, config.learning_rate,
                        self.model.trainable_variables, config.weight_decay)

  # -- around an inner loop --

  def loop_begin(self) -> None:
    self.compression_state.apply()  # After a restore: each replica's own.

  def loop_end(self) -> None:
    pass

  def on_restore(self) -> None:
    pass

  def checkpoint_items(self) -> Dict[str, object]:
    if self.compression_state:
      return {"compression": self.compression_state.checkpoint}
    return {}

  # -- inside the step (replica context) --

  def weights(self) -> Optional[List[tf.Tensor]]:
    """The values the step runs the model on (None: its variables)."""
    return None

  def apply(self, grads, scale, step, exact: bool):
    """Reduces this replica's `grads` (of the loss times `scale`) and
    applies them with the recipe's rate and clipping. Returns (ok, the
    step's means: `grad_norm` of the reduced gradient, before clipping, and
    the recipe's)."""
    compressor = self.exact if exact else self.compressor
    stateful = not exact and bool(self.compression_state)
    state = self.compression_state.read() if stateful else {}
    if stateful and scale is not None:  # Residuals outlive the loss scale.
      grads, scale = [g / scale for g in grads], None
    grads, state = compressor.reduce(grads, state, step.read_value())
    ok, means = precision_lib.unscale_and_apply(
        self.optimizer, grads, self.model.trainable_variables,
        self.loss_scale, scale, self.recipe, step)
    if stateful:
      self.compression_state.write(state, ok)
    # `ok` and the norm follow the all-reduce: the same on every replica.
    return ok, means

  # -- bytes and memory --

  @property
  def stage(self) -> str:
    return "none"

  def wire(self, step: int) -> collectives.WireBytes:
    """The bytes of step `step`."""
    return accounting.wire(self.strategy.num_replicas_in_sync,
                           self.compressor.bytes_at(max(step - 1, 0)))

  def bytes_total(self, steps: int) -> float:
    """Bytes one replica handed to the collectives in steps 0..steps-1."""
    wire = self.wire(steps)
    return (self.compressor.bytes_total(steps)
            + wire.gathers_per_step * wire.shard_bytes * steps)

  def memory(self) -> Dict[str, float]:
    """`memory/...`: what one replica holds."""
    return accounting.memory(  # Keras: iterations, learning rate, slots.
        "none", self.strategy.num_replicas_in_sync,
        self.model.trainable_variables, self.optimizer.variables[2:])


class Sharded(Replicated):
  """`--shard=optimizer|gradients|weights`: ZeRO stages 1-3."""

  def __init__(self, options, config, strategy, model, loss_scale, recipe):
    self.sharding = zero.Sharding(
        options.shard, strategy, model, config.optimizer,
        config.learning_rate, options.allreduce_bucket_mb,
        config.weight_decay)
    super().__init__(options, config, strategy, model, loss_scale, recipe)

  @staticmethod
  def host_model(options) -> bool:
    """Stage 3 keeps no full weights on the devices: the model is a host
    copy for evaluation and checkpoints (`sharding/zero.py`)."""
    return options.shard == "weights"

  def _make_optimizer(self, config):
    del config
    return self.sharding.optimizer

  @property
  def stage(self) -> str:
    return self.sharding.stage

  def loop_begin(self) -> None:
    super().loop_begin()
    self.sharding.before_train()

  def loop_end(self) -> None:
    self.sharding.refresh()  # Evaluation and checkpoints read it.

  def on_restore(self) -> None:
    self.sharding.on_restore()

  def weights(self):
    return self.sharding.weights()

  def apply(self, grads, scale, step, exact: bool):
    compressor = self.exact if exact else self.compressor
    return self.sharding.apply(
        grads, lambda g: compressor.reduce(g, {}, step)[0], self.loss_scale,
        scale, self.recipe, step)

  def wire(self, step: int) -> collectives.WireBytes:
    return accounting.wire(
        self.strategy.num_replicas_in_sync,
        self.compressor.bytes_at(max(step - 1, 0)), self.stage,
        accounting.variable_bytes(self.sharding.state.shards),
        self.steps_per_loop)

  def memory(self) -> Dict[str, float]:
    state = self.sharding.state
    return accounting.memory(
        self.stage, self.strategy.num_replicas_in_sync,
        self.model.trainable_variables, state.slots, state.shards,
        state.layout.padding)


def kind(options):
  """The reduction class `--shard` selects."""
  return Replicated if options.shard == "none" else Sharded
