"""Predicts a schedule's step: its timeline, time, bubble and memory.

Each device runs its actions in the schedule's order; an action starts when
the device's previous action and the actions it depends on have finished
(plus `transfer` seconds when the dependency ran on another device), and
lasts its chunk's measured cost plus `overhead`. This is exactly the
discipline the executor enforces, so with the right costs the simulated
timeline is the measured one.

Memory is counted per device in micro-batch activations: a (chunk,
micro-batch) is live from the start of its F until its B or W ends. Bytes
follow what the executor keeps: from F to I (or B) the chunk's activations
(with recompute only its input, and the activations again while I or B
recomputes them); from I to W what W needs (`weight_grad_bytes`).
"""

import dataclasses
from typing import Dict, List, Sequence, Tuple

from dist_loop.modes.pipeline import schedule as schedule_lib
from dist_loop.modes.pipeline.schedule import (BACKWARD, FORWARD, INPUT_GRAD,
                                               WEIGHT_GRAD, Action, Schedule)


@dataclasses.dataclass(frozen=True)
class ChunkCosts:
  """Per-chunk, per-micro-batch costs in seconds and bytes."""

  forward: Tuple[float, ...]
  input_grad: Tuple[float, ...]
  weight_grad: Tuple[float, ...]
  backward: Tuple[float, ...]  # B, measured as one action (about I + W).
  activation_bytes: Tuple[float, ...] = ()  # Kept by F for the backward.
  weight_grad_bytes: Tuple[float, ...] = ()  # Kept by I for W.
  input_bytes: Tuple[float, ...] = ()  # The chunk's input (recompute).
  recomputes: Tuple[bool, ...] = ()  # Per chunk: F keeps only the input.
  overhead: float = 0.0  # Per action.
  transfer: float = 0.0  # Per dependency that crosses devices.

  @classmethod
  def unit(cls, num_chunks: int, forward: float = 1.0,
           backward: float = 2.0) -> "ChunkCosts":
    """Equal chunks, I = W = B/2: what schedules are built and drawn with."""
    n = num_chunks
    return cls((forward,) * n, (backward / 2,) * n, (backward / 2,) * n,
               (backward,) * n, (1.0,) * n, (1.0,) * n, (0.0,) * n)

  def seconds(self, action: Action) -> float:
    table = {FORWARD: self.forward, INPUT_GRAD: self.input_grad,
             WEIGHT_GRAD: self.weight_grad, BACKWARD: self.backward}
    return table[action.kind][action.chunk] + self.overhead


Bar = Tuple[int, Action, float, float]  # device, action, start, end


@dataclasses.dataclass(frozen=True)
class Prediction:
  """A simulated step."""

  bars: List[Bar]
  step_time: float  # From the first start to the last end.
  bubble: float  # Idle share of devices x step_time.
  peak_live: List[int]  # Per device: most live micro-batch activations.
  peak_bytes: List[float]  # Per device.

  @property
  def peak_mb(self) -> float:
    return max(self.peak_bytes) / 2**20 if self.peak_bytes else 0.0


def simulate(schedule: Schedule, costs: ChunkCosts = None) -> Prediction:
  """Times every action of `schedule` under `costs` (default: unit costs).

  Raises:
    UserError: the schedule deadlocks.
  """
  if not isinstance(schedule, Schedule):
    schedule = Schedule.of(schedule)
  if costs is None:
    costs = ChunkCosts.unit(schedule.num_chunks)
  done: Dict[Tuple[str, int, int], Tuple[float, int]] = {}
  free = [0.0] * schedule.num_devices
  bars: List[Bar] = []
  for d, action in schedule_lib.execution_order(schedule):
    start = free[d]
    for need in schedule_lib.needs(action, schedule.num_chunks):
      end, device = done[need]
      start = max(start, end + (costs.transfer if device != d else 0.0))
    end = start + costs.seconds(action)
    for key in schedule_lib.provides(action):
      done[key] = (end, d)
    free[d] = end
    bars.append((d, action, start, end))
  span = max(e for _, _, _, e in bars) - min(s for _, _, s, _ in bars)
  busy = sum(e - s for _, _, s, e in bars)
  bubble = 1.0 - busy / (schedule.num_devices * span) if span > 0 else 0.0
  live, nbytes = _memory(bars, schedule.num_devices, costs)
  return Prediction(bars, span, bubble, live, nbytes)


def _memory(bars: Sequence[Bar], num_devices: int, costs: ChunkCosts):
  """Peak live activations and bytes per device, from the timeline."""
  def pick(values, c):
    return values[c] if values else 0.0

  events = []  # (time, order, device, live delta, bytes delta)
  for d, a, start, end in bars:
    c = a.chunk
    act = pick(costs.activation_bytes, c)
    recomputes = bool(costs.recomputes) and costs.recomputes[c]
    held = pick(costs.input_bytes, c) if recomputes else act
    if a.kind == FORWARD:
      events.append((start, 1, d, 1, held))
    elif a.kind in (INPUT_GRAD, BACKWARD):
      if recomputes:  # The activations, recomputed for the backward.
        events.append((start, 1, d, 0, act))
      freed = held + (act if recomputes else 0.0)
      kept = pick(costs.weight_grad_bytes, c) if a.kind == INPUT_GRAD else 0
      events.append((end, 0, d, -1 if a.kind == BACKWARD else 0,
                     kept - freed))
    else:
      events.append((end, 0, d, -1, -pick(costs.weight_grad_bytes, c)))
  live, nbytes = [0] * num_devices, [0.0] * num_devices
  peak_live, peak_bytes = [0] * num_devices, [0.0] * num_devices
  for _, _, d, dl, db in sorted(events):  # Frees before allocations.
    live[d] += dl
    nbytes[d] += db
    peak_live[d] = max(peak_live[d], live[d])
    peak_bytes[d] = max(peak_bytes[d], nbytes[d])
  return peak_live, peak_bytes


def ideal_bubble(schedule: Schedule) -> float:
  """The bubble of `schedule` with equal chunks and B = 2F: the schedule's
  own share of idle time, whatever the model (GPipe and 1F1B:
  (K-1)/(M+K-1))."""
  return simulate(schedule).bubble
