"""A reducer that keeps the whole model and optimizer on every replica.

`Replicated` reduces with one compressor (`dist_loop/parallel/compression`):
`--reducer=exact` (the plain all-reduce), `cast` (fp16 or bf16 on the
wire), `powersgd`, `topk`, or an extension's (`Replicated.of`). A
compressor with state (error feedback) keeps it per replica and writes it
only when the step is applied; it is the checkpoint's `compression` entry,
so without one the checkpoint holds what it always did. Such a compressor
gets unscaled gradients (a residual outlives the loss scale it was
computed under). A compressor's warm-up (`exact_steps`) runs the exact sum
(`exact=True`), which neither reads nor moves the compressor's state.
"""

from typing import Dict, List, Optional

import tensorflow as tf

from dist_loop.parallel import compression
from dist_loop.parallel.sharding import accounting, collectives
from dist_loop.training import optim
from dist_loop.training import precision as precision_lib


class Replicated:
  """The whole model and optimizer on every replica, one compressor.

  A reducer is built once per run, outside any `tf.function`; `weights` and
  `apply` run in replica context, the rest on the host.

  Args:
    options: the reducer's `Options` (None if it has none).
    config: the run's `Config` (optimizer, learning rate, seed).
    strategy: the run's strategy.
    model: the model, its variables mirrored.
    loss_scale: the run's `DynamicLossScale`, or None.
    recipe: the run's training recipe (rate, clipping, weight decay).
  """

  Options = None
  # The compressor (`of` sets it; `compressor_for` may choose by options).
  compressor_class: Optional[type] = None
  # Reducers with the same key write the same checkpoint (`REDUCERS`'s
  # layout key); None: this reducer's name.
  checkpoint_layout: Optional[str] = None

  def __init__(self, options, config, strategy, model, loss_scale, recipe):
    self.strategy, self.model, self.loss_scale = strategy, model, loss_scale
    self.recipe = recipe
    self.steps_per_loop = config.steps_per_loop
    variables = model.trainable_variables
    self.optimizer = self._make_optimizer(config)
    self.compressor = compression.make(self.compressor_for(options), options,
                                       variables, config.seed)
    self.exact = compression.COMPRESSORS.get("none")(options, variables)
    self.compression_state = compression.State(
        strategy, self.compressor.initial_state())

  @classmethod
  def of(cls, compressor_class) -> type:
    """The replicated reducer of `compressor_class`, with its `Options`."""
    return type(compressor_class.__name__ + "Reducer", (cls,), {
        "Options": getattr(compressor_class, "Options", None),
        "compressor_class": compressor_class,
        "__doc__": compressor_class.__doc__})

  @classmethod
  def async_checkpoint_refusal(cls, name: str, options) -> Optional[str]:
    """Why `--async_checkpoint` cannot save this reducer's state (None: it
    can). TensorFlow's background save copies mirrored variables; a
    compressor's per-replica state (error feedback, PowerSGD's Q) it
    cannot."""
    compressor = cls.compressor_for(options)
    if compressor.initial_state is compression.Compressor.initial_state:
      return None
    return (f"--reducer={name} checkpoints each replica's own compressor "
            "state, which the background save cannot copy")

  @classmethod
  def compressor_for(cls, options) -> type:
    """The compressor class these options ask for."""
    del options
    return cls.compressor_class

  @classmethod
  def check(cls, config) -> None:
    """The rules of this reducer's options. Raises UserError."""
    cls.compressor_for(config.reducer_options).check(config.reducer_options)

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
    """The ZeRO stage: none, optimizer, gradients or weights."""
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
