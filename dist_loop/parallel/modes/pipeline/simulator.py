"""Predicts a schedule's step: its timeline, time, bubble and memory.

Each device runs its actions in the schedule's order; an action starts when
the device's previous action and the actions it depends on have finished
(plus `transfer` seconds when the dependency ran on another device), and
takes its chunk's measured cost plus `overhead`. This is exactly the
discipline the executor enforces, so with the right costs the simulated
timeline is the measured one.

Devices may share cores: logical CPU devices all run on the process's
cores. An action has two measured times: alone (with the other cores free:
a B then computes its input and weight gradients on two cores at once),
and crowded (while the other cores run actions too: no core to spare, and
the memory shared). `cores` says how many actions run at once without
sharing a core (infinite: every device has its own, as GPUs do); beyond
that, the running actions share the cores evenly and each slows in
proportion. With one time per action (crowded = alone) and enough cores,
the simulation is the plain one above, to the last bit.

Memory is counted per device in micro-batch activations: a (chunk,
micro-batch) is live from the start of its F until its B or W ends. Bytes
follow what the executor keeps: from F to I (or B) the chunk's activations
(with recompute only its input, and the activations again while I or B
recomputes them); from I to W what W needs (`weight_grad_bytes`).
"""

import dataclasses
import math
from typing import Dict, List, Sequence, Tuple

from dist_loop.parallel.modes.pipeline import action as action_lib
from dist_loop.parallel.modes.pipeline import schedule as schedule_lib
from dist_loop.parallel.modes.pipeline.action import (BACKWARD, FORWARD, INPUT_GRAD,
                                             KINDS, WEIGHT_GRAD, Action)
from dist_loop.parallel.modes.pipeline.schedule import Schedule


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
  cores: float = math.inf  # Actions that run at once without sharing.
  # Per chunk: (F, I, W, B) seconds (`KINDS`' order) while other actions
  # run; () = alone's.
  crowded: Tuple[Tuple[float, float, float, float], ...] = ()

  @classmethod
  def unit(cls, num_chunks: int, forward: float = 1.0,
           backward: float = 2.0) -> "ChunkCosts":
    """Equal chunks, I = W = B/2: what schedules are built and drawn with."""
    n = num_chunks
    return cls((forward,) * n, (backward / 2,) * n, (backward / 2,) * n,
               (backward,) * n, (1.0,) * n, (1.0,) * n, (0.0,) * n)

  def __post_init__(self):
    if not self.cores > 0:
      raise ValueError(f"cores must be positive, not {self.cores}")

  def seconds(self, action: Action, crowded: bool = False) -> float:
    """One action's seconds: alone, or while other actions run."""
    if crowded and self.crowded:
      row = self.crowded[action.chunk]
      return row[KINDS.index(action.kind)] + self.overhead
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
  schedule_lib.execution_order(schedule)  # Raises if it deadlocks.
  bars = _timeline(schedule, costs)
  span = max(e for _, _, _, e in bars) - min(s for _, _, s, _ in bars)
  busy = sum(e - s for _, _, s, e in bars)
  bubble = 1.0 - busy / (schedule.num_devices * span) if span > 0 else 0.0
  live, nbytes = _memory(bars, schedule.num_devices, costs)
  return Prediction(bars, span, bubble, live, nbytes)


class _Running:
  """An action in progress: `left` seconds of it, timed alone, remain as of
  time `since`, and it runs at `speed` (1: as fast as alone)."""

  def __init__(self, action, start, alone, crowded):
    self.action, self.start = action, start
    self.alone, self.crowded = alone, crowded
    self.since, self.left, self.speed = start, alone, 1.0

  def end(self) -> float:
    return self.since + self.left / self.speed

  def set_speed(self, now: float, running: int, cores: float) -> None:
    """The speed with `running` actions at once on `cores`."""
    # A zero time (below the clock's resolution) has no speed to lose.
    slower = (self.alone / self.crowded if self.alone > 0
              and 0 < self.crowded < math.inf else 1.0)
    speed = 1.0 if running == 1 else slower * min(1.0, cores / running)
    if speed != self.speed:  # Untouched otherwise: exact ends at speed 1.
      self.left -= (now - self.since) * self.speed
      self.since, self.speed = now, speed


def _timeline(schedule: Schedule, costs: ChunkCosts) -> List[Bar]:
  """Every action's (device, action, start, end), by an event loop: start
  what is ready, set what runs to its speed, advance to the next end (or
  the next arrival of a transfer)."""
  rows, k = schedule.devices, schedule.num_devices
  position, free = [0] * k, [0.0] * k
  done: Dict[Tuple[str, int, int], Tuple[float, int]] = {}
  running: Dict[int, _Running] = {}
  bars: List[Bar] = []
  now = 0.0
  while True:
    arrivals = []  # When a waiting action's inputs arrive.
    for d in range(k):
      if d in running or position[d] == len(rows[d]):
        continue
      action = rows[d][position[d]]
      needs = action_lib.needs(action, schedule.num_chunks)
      if not all(n in done for n in needs):
        continue
      ready = free[d]
      for n in needs:
        end, device = done[n]
        ready = max(ready, end + (costs.transfer if device != d else 0.0))
      if ready > now:
        arrivals.append(ready)
        continue
      running[d] = _Running(action, ready, costs.seconds(action),
                            costs.seconds(action, crowded=True))
    if not running:
      if not arrivals:
        return bars
      now = min(arrivals)
      continue
    for r in running.values():
      r.set_speed(now, len(running), costs.cores)
    now = min([r.end() for r in running.values()] + arrivals)
    for d, r in list(running.items()):
      end = r.end()
      if end <= now:
        del running[d]
        bars.append((d, r.action, r.start, end))
        for key in action_lib.provides(r.action):
          done[key] = (end, d)
        free[d] = end
        position[d] += 1


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
