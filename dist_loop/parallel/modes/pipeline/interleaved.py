"""Megatron's interleaved 1F1B: V non-adjacent chunks of layers per device.

The model is cut into K*V chunks and chunk c lives on device c mod K, so a
micro-batch passes every device V times. Each device's forward units walk
its chunks in groups of K micro-batches (K micro-batches through its first
chunk, the same K through its second, ...), its backward units the same
with the chunks reversed; a device warms up with (K-d-1)*2 + (V-1)*K
forward units, then alternates one forward and one backward unit, then
drains. A chunk is 1/V of a device's layers, so the warm-up and drain
shrink V times: the bubble is about (K-1)/(V*M), at the price of V times
the transfers between devices.
"""

from dist_loop.core.errors import UserError
from dist_loop.parallel.modes.pipeline.schedule import (SCHEDULES, Action, B, F,
                                               Schedule)

DEFAULT_VIRTUAL_STAGES = 2


@SCHEDULES.register("interleaved_1f1b")
def interleaved_1f1b(num_stages: int, num_microbatches: int,
                     virtual_stages: int = 0) -> Schedule:
  """The interleaved schedule for K devices, M micro-batches, V chunks each.

  Raises:
    UserError: M is not a multiple of K (micro-batches go round in groups
      of K), or V < 2 (that is 1F1B).
  """
  k, m = num_stages, num_microbatches
  v = virtual_stages or DEFAULT_VIRTUAL_STAGES
  if v < 2:
    raise UserError(f"interleaved_1f1b needs --virtual_stages >= 2, got {v}; "
                    "with one chunk per device use --pipeline_schedule=1f1b")
  if m % k:
    raise UserError(
        f"interleaved_1f1b sends micro-batches round in groups of "
        f"--num_stages={k}, so --num_microbatches={m} must be a multiple of "
        f"{k}; use --num_microbatches={max(k, m - m % k)} or {m - m % k + k}")
  placement = [c % k for c in range(k * v)]
  total = m * v  # Forward (and backward) units per device.

  def unit(d: int, j: int, backward: bool) -> Action:
    local = (j // k) % v
    if backward:
      local = v - 1 - local
    microbatch = (j // (k * v)) * k + j % k
    chunk = local * k + d
    return B(microbatch, chunk) if backward else F(microbatch, chunk)

  devices = []
  for d in range(k):
    warmup = min((k - d - 1) * 2 + (v - 1) * k, total)
    actions = [unit(d, j, False) for j in range(warmup)]
    for j in range(total - warmup):
      actions += [unit(d, warmup + j, False), unit(d, j, True)]
    actions += [unit(d, j, True) for j in range(total - warmup, total)]
    devices.append(actions)
  return Schedule.of(devices, placement)
