"""What a sync replica holds and sends, against ZeRO's formulas.

Memory, per device, in bytes, counted from the variables the run built (the
gradient from its shapes, since it is a tensor of the step):

* `weights`: the full weights on the device (not under stage 3), plus the
  float32 shard the optimizer updates (stages 1-3);
* `gradients`: the reduced gradient a replica keeps until the update: all
  of it, or its shard (stages 2 and 3);
* `optimizer`: the slots, whole or shards.

ZeRO's formula for K bytes of optimizer state per parameter (Adam in
float32: K = 8; `optimizer_bytes_per_parameter`), Psi parameters, N
replicas: (4 + 4 + K) Psi unsharded; 4 Psi + 4 Psi + K Psi / N (stage 1);
4 Psi + (4 + K) Psi / N (stage 2); (4 + 4 + K) Psi / N (stage 3). What the
run adds to it is reported beside it: the padding of each variable to a
multiple of N, the float32 weight shard of stages 1 and 2 (in ZeRO it is
part of K under mixed precision), and the buffers that live only during a
step (`transient`: the gathered weights of stage 3). Not counted: on CPU,
stages 2 and 3 reduce each bucket whole before slicing it (there is no
reduce-scatter), so a bucket's full size also lives briefly.

Bytes on the wire: `collectives.WireBytes`.
"""

from typing import Dict

import numpy as np

from dist_loop.parallel.sharding.collectives import WireBytes

MB = 2.0**20


def _bytes(variables) -> int:
  return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
             for v in variables)


def zero_formula(stage: str, parameters: int, replicas: int,
                 k: float) -> float:
  """ZeRO's bytes per device (float32 weights and gradients)."""
  psi, n = parameters, replicas
  return {"none": (8 + k) * psi,
          "optimizer": 8 * psi + k * psi / n,
          "gradients": 4 * psi + (4 + k) * psi / n,
          "weights": (8 + k) * psi / n}[stage]


def memory(trainer) -> Dict[str, float]:
  """`memory/...` MB per device of a sync trainer (see the module)."""
  model = trainer.model
  full = _bytes(model.trainable_variables)
  parameters = full // 4
  sharding = trainer.sharding
  replicas = trainer.strategy.num_replicas_in_sync
  if sharding is None:
    stage, slots = "none", _bytes(trainer.optimizer.variables[2:])
    weights, gradients, k = full, full, slots / max(parameters, 1)
    padding = transient = 0
  else:
    stage, state = sharding.stage, sharding.state
    shard = _bytes(state.shards)  # One replica's.
    slots = _bytes(state.slots)
    weights = shard + (0 if stage == "weights" else full)
    gradients = full if stage == "optimizer" else shard
    # Float32 slots per parameter, unpadded (Adam: 2 slots, K = 8).
    k = 4.0 * len(state.slots) / max(len(state.shards), 1)
    padding = 4 * state.layout.padding // replicas
    transient = full if stage == "weights" else 0
  held = weights + gradients + slots
  out = {"memory/weights_mb": weights / MB,
         "memory/gradients_mb": gradients / MB,
         "memory/optimizer_mb": slots / MB,
         "memory/held_mb": held / MB,
         "memory/zero_formula_mb": zero_formula(stage, parameters, replicas,
                                                k) / MB,
         "memory/padding_mb": padding / MB,
         "memory/transient_mb": transient / MB}
  if stage == "weights":
    out["memory/host_weights_mb"] = full / MB
  return out


def wire(trainer, step: int) -> WireBytes:
  """The bytes of one step of a sync trainer (sharded or not)."""
  gradient = trainer.compressor.bytes_at(max(step - 1, 0))
  sharding = trainer.sharding
  if sharding is None:
    return WireBytes(trainer.strategy.num_replicas_in_sync, gradient, 0, 0)
  gathers = 1.0
  if sharding.stage == "weights":  # And the host copy, once per loop.
    gathers += 1.0 / trainer.config.steps_per_loop
  return WireBytes(trainer.strategy.num_replicas_in_sync, gradient,
                   _bytes(sharding.state.shards), gathers)
