"""What a sync replica holds and sends, against ZeRO's formulas.

It takes values (stage, replica count, the variables a replica holds), not
a trainer, so it sits below the modes.

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

from typing import Dict, Sequence

import numpy as np

from dist_loop.parallel.sharding.collectives import WireBytes

MB = 2.0**20


def variable_bytes(variables) -> int:
  """The bytes of `variables` (anything with a shape and a dtype)."""
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


def memory(stage: str, replicas: int, model_variables: Sequence,
           slots: Sequence, shards: Sequence = (),
           padding: int = 0) -> Dict[str, float]:
  """`memory/...` MB per device of a sync replica (see the module).

  Args:
    stage: the ZeRO stage, "none" to "weights".
    replicas: the replicas in sync.
    model_variables: the model's trainable variables (full).
    slots: the optimizer's slot variables one replica holds (whole
      unsharded, shards otherwise).
    shards: one replica's float32 weight shards (sharded stages).
    padding: elements added to make every variable divide by `replicas`.
  """
  full = variable_bytes(model_variables)
  parameters = full // 4
  slot_bytes = variable_bytes(slots)
  if stage == "none":
    weights, gradients, k = full, full, slot_bytes / max(parameters, 1)
    padding_bytes = transient = 0
  else:
    shard = variable_bytes(shards)  # One replica's.
    weights = shard + (0 if stage == "weights" else full)
    gradients = full if stage == "optimizer" else shard
    # Float32 slots per parameter, unpadded (Adam: 2 slots, K = 8).
    k = 4.0 * len(slots) / max(len(shards), 1)
    padding_bytes = 4 * padding // replicas
    transient = full if stage == "weights" else 0
  held = weights + gradients + slot_bytes
  out = {"memory/weights_mb": weights / MB,
         "memory/gradients_mb": gradients / MB,
         "memory/optimizer_mb": slot_bytes / MB,
         "memory/held_mb": held / MB,
         "memory/zero_formula_mb": zero_formula(stage, parameters, replicas,
                                                k) / MB,
         "memory/padding_mb": padding_bytes / MB,
         "memory/transient_mb": transient / MB}
  if stage == "weights":
    out["memory/host_weights_mb"] = full / MB
  return out


def wire(replicas: int, gradient_bytes: int, stage: str = "none",
         shard_bytes: int = 0, steps_per_loop: int = 1) -> WireBytes:
  """The bytes of one sync step: `gradient_bytes` handed to the reduction
  (the compressor's), and under a stage the all-gathers of `shard_bytes`
  (stage 3 also gathers the host copy once per loop of `steps_per_loop`)."""
  if stage == "none":
    return WireBytes(replicas, gradient_bytes, 0, 0)
  gathers = 1.0
  if stage == "weights":  # And the host copy, once per loop.
    gathers += 1.0 / steps_per_loop
  return WireBytes(replicas, gradient_bytes, shard_bytes, gathers)
