"""Pipeline schedules as data: for each device, the ordered list of its actions.

The model is cut into C *chunks* of consecutive layers; the schedule's
`placement` says which device (a *stage*) holds each chunk (V = C/K chunks
per device; V=1 for GPipe and 1F1B, where chunk k is on device k). An action
(`action.py`: F, I, W or B) works on one (chunk, micro-batch).

A schedule says only the ORDER of the actions on each device; the data
dependencies are implied by the actions' kinds (`action.needs`). The
executor runs a schedule as given, so a schedule can be printed, tested,
simulated (`simulator.py`) and drawn before any TensorFlow runs. A new
schedule is one function registered in `SCHEDULES`; it returns a
`Schedule`, or, for one chunk per device, just a list of per-device action
lists:

    @SCHEDULES.register("my_schedule")
    def my_schedule(num_stages, num_microbatches) -> Schedule: ...

A builder that also takes `virtual_stages` (interleaved, ZB-V) is given
`--virtual_stages`, 0 meaning its own default. The action types are
imported from here by builders (`from ...schedule import SCHEDULES, F, B`).
"""

import dataclasses
import inspect
from typing import List, Sequence, Tuple

from dist_loop.core.errors import UserError
from dist_loop.parallel.modes.pipeline.action import (  # noqa: F401  (builders' API)
    BACKWARD, FORWARD, INPUT_GRAD, KINDS, WEIGHT_GRAD, Action, B, F, I, W,
    needs, provides)
from dist_loop.core.registry import Registry

AUTO = "auto"  # --pipeline_schedule=auto: the planner picks (`planner.py`).


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per-device action lists (every action's chunk set) and chunk -> device.

  Iterating gives the per-device lists, so a one-chunk schedule reads like
  the per-stage lists it was written as.
  """

  devices: Tuple[Tuple[Action, ...], ...]
  placement: Tuple[int, ...]

  @classmethod
  def of(cls, devices: Sequence[Sequence[Action]],
         placement: Sequence[int] = None) -> "Schedule":
    """From lists; actions with chunk -1 get their device's only chunk."""
    placement = tuple(range(len(devices)) if placement is None
                      else placement)
    own = {d: [c for c, p in enumerate(placement) if p == d]
           for d in range(len(devices))}
    fixed = []
    for d, actions in enumerate(devices):
      row = []
      for a in actions:
        if a.chunk < 0:
          if len(own[d]) != 1:
            raise UserError(f"device {d} holds chunks {own[d]}: its action "
                            f"{a} must name its chunk")
          a = dataclasses.replace(a, chunk=own[d][0])
        row.append(a)
      fixed.append(tuple(row))
    return cls(tuple(fixed), placement)

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  @property
  def num_chunks(self) -> int:
    return len(self.placement)

  @property
  def virtual_stages(self) -> int:
    return self.num_chunks // max(self.num_devices, 1)

  def kinds(self) -> set:
    return {a.kind for row in self.devices for a in row}

  def label(self, action: Action) -> str:
    """`F3`, or `F3.1` (the device's second chunk) when devices hold more
    than one chunk."""
    if self.virtual_stages == 1:
      return str(action)
    local = [c for c, p in enumerate(self.placement)
             if p == self.placement[action.chunk]].index(action.chunk)
    return f"{action}.{local}"

  def __iter__(self):
    return iter([list(row) for row in self.devices])

  def __len__(self) -> int:
    return len(self.devices)

  def __getitem__(self, device: int) -> List[Action]:
    return list(self.devices[device])


SCHEDULES: Registry = Registry("pipeline schedule", "pipeline_schedule")


class ScheduleChoices:
  """What --pipeline_schedule accepts: a registered schedule, or auto."""

  def names(self) -> List[str]:
    return [AUTO] + SCHEDULES.names()

  def __contains__(self, name: str) -> bool:
    return name == AUTO or name in SCHEDULES


def takes_virtual_stages(name: str) -> bool:
  return "virtual_stages" in inspect.signature(
      SCHEDULES.get(name)).parameters


def make(name: str, num_stages: int, num_microbatches: int,
         virtual_stages: int = 0) -> Schedule:
  """The registered schedule `name` for (K, M, V), checked by `validate`.

  Raises:
    UserError: the schedule does not exist or cannot run (K, M, V).
  """
  builder = SCHEDULES.get(name)
  if takes_virtual_stages(name):
    schedule = builder(num_stages, num_microbatches,
                       virtual_stages=virtual_stages)
  elif virtual_stages > 1:
    raise UserError(f"--pipeline_schedule={name} puts one chunk of layers "
                    f"on each device, not --virtual_stages={virtual_stages}; "
                    "drop --virtual_stages or use interleaved_1f1b")
  else:
    schedule = builder(num_stages, num_microbatches)
  if not isinstance(schedule, Schedule):
    schedule = Schedule.of(schedule)
  validate(schedule, num_stages, num_microbatches)
  return schedule


def validate(schedule, num_stages: int, num_microbatches: int) -> None:
  """Raises UserError unless `schedule` is complete and can run.

  Complete: each chunk's device runs, for every micro-batch, F once and
  either B once or I and W once each, F before I or B, I before W.
  Runnable: following the per-device orders with the dependencies between
  chunks never deadlocks (`execution_order`).
  """
  if not isinstance(schedule, Schedule):
    schedule = Schedule.of(schedule)
  if schedule.num_devices != num_stages:
    raise UserError(f"schedule has {schedule.num_devices} devices, expected "
                    f"{num_stages}")
  if sorted(set(schedule.placement)) != list(range(num_stages)):
    raise UserError(f"schedule places its chunks on devices "
                    f"{list(schedule.placement)}: every device needs one")
  seen = {}
  for d, actions in enumerate(schedule.devices):
    for a in actions:
      key = (a.chunk, a.microbatch)
      if not (0 <= a.chunk < schedule.num_chunks
              and 0 <= a.microbatch < num_microbatches):
        raise UserError(f"device {d} runs {a} of chunk {a.chunk}, outside "
                        f"{schedule.num_chunks} chunks x {num_microbatches} "
                        "micro-batches")
      if schedule.placement[a.chunk] != d:
        raise UserError(f"device {d} runs {a} of chunk {a.chunk}, which is "
                        f"on device {schedule.placement[a.chunk]}")
      seen.setdefault(key, []).append(a.kind)
  for c in range(schedule.num_chunks):
    for i in range(num_microbatches):
      kinds = seen.get((c, i), [])
      if kinds not in ([FORWARD, BACKWARD],
                       [FORWARD, INPUT_GRAD, WEIGHT_GRAD]):
        what = " ".join(kinds) or "nothing"
        raise UserError(
            f"chunk {c} of the schedule does not run F i and B i (or F, I, W)"
            f" exactly once, in that order, for micro-batch {i}: {what}")
  execution_order(schedule)


def execution_order(schedule: Schedule) -> List[Tuple[int, Action]]:
  """All (device, action) pairs in an order that respects every dependency
  and each device's own order (round-robin over the devices that can go).
  The executor creates its ops in this order.

  Raises:
    UserError: the schedule deadlocks (a device waits for work that waits
      for it).
  """
  rows = schedule.devices
  position = [0] * len(rows)
  ready = set()
  order = []
  total = sum(len(a) for a in rows)
  while len(order) < total:
    progressed = False
    for d, actions in enumerate(rows):
      while position[d] < len(actions):
        action = actions[position[d]]
        if not all(n in ready
                   for n in needs(action, schedule.num_chunks)):
          break
        ready.update(provides(action))
        order.append((d, action))
        position[d] += 1
        progressed = True
    if not progressed:
      stuck = ", ".join(f"device {d} at {schedule.label(rows[d][position[d]])}"
                        for d in range(len(rows))
                        if position[d] < len(rows[d]))
      raise UserError(f"the pipeline schedule deadlocks: {stuck}")
  return order


def peak_activations(actions: Sequence[Action]) -> int:
  """Most (chunk, micro-batch) activations a device holds at once: from
  its F until its B or W."""
  alive, peak = 0, 0
  for action in actions:
    if action.kind == FORWARD:
      alive += 1
    elif action.kind in (BACKWARD, WEIGHT_GRAD):
      alive -= 1
    peak = max(peak, alive)
  return peak


def bubble_formula(num_stages: int, num_microbatches: int) -> float:
  """GPipe's idle fraction (K-1)/(M+K-1), for equal chunks."""
  return (num_stages - 1) / (num_microbatches + num_stages - 1)


def format_schedule(schedule: Schedule) -> str:
  """One line per device: `device 0: F0 F1 B0 F2 B1 ...`."""
  if not isinstance(schedule, Schedule):
    schedule = Schedule.of(schedule)
  lines = []
  for d, actions in enumerate(schedule.devices):
    chunks = [c for c, p in enumerate(schedule.placement) if p == d]
    lines.append(f"device {d} (chunks {','.join(map(str, chunks))}): "
                 + " ".join(schedule.label(a) for a in actions))
  return "\n".join(lines)
