"""Zero-bubble schedules (Qi et al., 2023): ZB-H1 and ZB-V.

Splitting each backward into I (the input gradient, which the previous
chunk waits for) and W (the weight gradients, which nobody waits for) lets
a device defer its Ws into the time it would otherwise idle.

* `zb_h1`: one chunk per device. Stage k warms up like 1F1B (K-k-1
  forwards), then runs F, I and the W of the micro-batch k places back, so
  it holds at most K micro-batches, 1F1B's peak (on its first stage). With
  F = I = W the bubble falls from 1F1B's (K-1)/(M+K-1) to (K-1)/(3M+K-1).
* `zbv`: two chunks per device in a V (device d holds chunks d and 2K-1-d,
  so the first and the last chunk share device 0 and a micro-batch turns
  round on device K-1). Each chunk is half a device's layers; at most 2K
  live chunk activations per device, 1F1B's peak in bytes. It is built by a
  memory-bounded list scheduler (`greedy`) run once with unit costs: at
  every time step each free device starts the next ready I (earlier chunks
  first), else the next ready F if it holds fewer activations than its
  limit (later chunks first, which finishes micro-batches sooner), else its
  oldest pending W. With F = I = W the only idle time left is the K-1
  chunk forwards device K-1 waits for at the start: (K-1)/(6M+K-1).

Either way the result is a fixed per-device order, i.e. data: the executor
and the simulator run it as written whatever the real costs.
"""

from typing import Dict, List, Sequence, Tuple

from dist_loop.core.errors import UserError
from dist_loop.parallel.modes.pipeline.schedule import (SCHEDULES, F, I, Schedule, W)


def greedy(placement: Sequence[int], num_microbatches: int,
           limits: Sequence[int]) -> Schedule:
  """The list schedule of F, I and W with unit costs (see the module doc).

  Args:
    placement: chunk -> device.
    num_microbatches: M.
    limits: per device, the most (chunk, micro-batch) activations it may
      hold (from F to W).

  Raises:
    UserError: the limits are too low for any progress.
  """
  num_chunks, m = len(placement), num_microbatches
  num_devices = max(placement) + 1
  chunks = [[c for c in range(num_chunks) if placement[c] == d]
            for d in range(num_devices)]
  finish: Dict[Tuple[str, int, int], int] = {}
  next_f = [0] * num_chunks
  next_i = [0] * num_chunks
  pending: List[List[Tuple[int, int]]] = [[] for _ in range(num_devices)]
  live = [0] * num_devices
  orders: List[list] = [[] for _ in range(num_devices)]
  left = 3 * num_chunks * m
  t, idle = 0, 0

  def done(key) -> bool:
    return key in finish and finish[key] <= t

  while left:
    started = False
    for d in range(num_devices):
      action = None
      for c in chunks[d]:  # The next I: earlier chunks first.
        i = next_i[c]
        if i < next_f[c] and done(("F", c, i)) and (
            c == num_chunks - 1 or done(("G", c + 1, i))):
          action, key = I(i, c), ("G", c, i)
          next_i[c] += 1
          pending[d].append((c, i))
          break
      if action is None and live[d] < limits[d]:
        for c in reversed(chunks[d]):  # The next F: later chunks first.
          i = next_f[c]
          if i < m and (c == 0 or done(("F", c - 1, i))):
            action, key = F(i, c), ("F", c, i)
            next_f[c] += 1
            live[d] += 1
            break
      if action is None:
        ready = [p for p in pending[d] if done(("G",) + p)]
        if ready:
          c, i = ready[0]
          pending[d].remove((c, i))
          action, key = W(i, c), ("W", c, i)
          live[d] -= 1
      if action is not None:
        orders[d].append(action)
        finish[key] = t + 1
        left -= 1
        started = True
    idle = 0 if started else idle + 1
    if idle > 2 * num_chunks + 2:
      raise UserError(f"the activation limits {list(limits)} leave the "
                      "zero-bubble schedule stuck; use more devices' memory")
    t += 1
  return Schedule.of(orders, placement)


@SCHEDULES.register("zb_h1")
def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
  """ZB-H1: 1F1B's warm-up, then F, I and a W deferred by k on stage k."""
  k_total, m = num_stages, num_microbatches
  devices = []
  for k in range(k_total):
    warmup = min(k_total - k - 1, m)
    actions = [F(i) for i in range(warmup)]
    for j in range(m):
      if warmup + j < m:
        actions.append(F(warmup + j))
      actions.append(I(j))
      if j >= k:
        actions.append(W(j - k))
    actions += [W(j) for j in range(max(m - k, 0), m)]
    devices.append(actions)
  return Schedule.of(devices)


@SCHEDULES.register("zbv")
def zbv(num_stages: int, num_microbatches: int,
        virtual_stages: int = 0) -> Schedule:
  """ZB-V: two chunks per device in a V, at 1F1B's peak memory.

  Raises:
    UserError: --virtual_stages is set to anything but 2.
  """
  if virtual_stages not in (0, 2):
    raise UserError(f"zbv puts 2 chunks on each device, not "
                    f"--virtual_stages={virtual_stages}; drop "
                    "--virtual_stages or use interleaved_1f1b")
  k = num_stages
  placement = list(range(k)) + list(reversed(range(k)))
  return greedy(placement, num_microbatches, [2 * k] * k)
