"""The ZeRO reducers: `--reducer=zero1|zero2|zero3`.

Each stage divides one more part of the replicated state among the
replicas (`dist_loop/parallel/sharding/zero.py`): the optimizer's slots
(zero1), also the reduced gradients (zero2), also the weights, gathered for
each step (zero3). Their reduction is a (maybe cast) sum that the stage
slices, so the wire dtype is their option; checkpoints are the same at
every stage and replica count, and the same as `--reducer=exact`'s.
"""

import dataclasses
from typing import Dict, Optional

from dist_loop.core.options import option
from dist_loop.parallel import compression
from dist_loop.parallel.compression import BucketOptions
from dist_loop.parallel.reducers.replicated import Replicated
from dist_loop.parallel.sharding import accounting, collectives, zero

# --zero_wire_dtype -> the compressor of the all-reduce.
WIRE_DTYPES = {"float32": "none", "fp16": "fp16", "bf16": "bf16"}


@dataclasses.dataclass(frozen=True)
class ZeroOptions(BucketOptions):
  """The flags of `--reducer=zero1|zero2|zero3` (the bucket size applies to
  the all-reduce and to the all-gathers)."""

  zero_wire_dtype: str = option(
      "float32", "The dtype the ZeRO stages' gradients cross the wire in: "
      "float32 (exact), fp16 or bf16 (cast, as --reducer=cast).",
      choices=tuple(WIRE_DTYPES))


class Sharded(Replicated):
  """A ZeRO stage (`stage_name`) over a (maybe cast) sum."""

  Options = ZeroOptions
  checkpoint_layout = "plain"
  stage_name = ""

  @classmethod
  def async_checkpoint_refusal(cls, name: str, options) -> Optional[str]:
    del options
    return (f"--reducer={name} checkpoints optimizer slots gathered from "
            "their shards, which the background save cannot copy (it can "
            "with --reducer=exact or cast)")

  def __init__(self, options, config, strategy, model, loss_scale, recipe):
    self.sharding = zero.Sharding(
        self.stage_name, strategy, model, config.optimizer,
        config.learning_rate, options.allreduce_bucket_mb,
        config.weight_decay)
    super().__init__(options, config, strategy, model, loss_scale, recipe)

  @classmethod
  def compressor_for(cls, options) -> type:
    return compression.COMPRESSORS.get(WIRE_DTYPES[options.zero_wire_dtype])

  @classmethod
  def check(cls, config) -> None:
    zero.check(cls.stage_name, config.optimizer)

  @classmethod
  def host_model(cls, options) -> bool:
    """Stage 3 keeps no full weights on the devices: the model is a host
    copy for evaluation and checkpoints (`sharding/zero.py`)."""
    del options
    return cls.stage_name == "weights"

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


class Zero1(Sharded):
  """ZeRO stage 1: each replica keeps the optimizer's slots of its shard."""

  stage_name = "optimizer"


class Zero2(Sharded):
  """ZeRO stage 2: also only its shard of the reduced gradient."""

  stage_name = "gradients"


class Zero3(Sharded):
  """ZeRO stage 3: also only its shard of the weights, gathered each step."""

  stage_name = "weights"
