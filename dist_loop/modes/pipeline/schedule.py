"""Pipeline schedules as data: for each stage, the ordered list of its actions.

An action is `F i` (the forward of micro-batch i on that stage) or `B i` (its
backward). A schedule says only the ORDER of the actions on each stage; the
data dependencies between stages are implied (F i on stage k needs F i on
stage k-1; B i on stage k needs F i on stage k and B i on stage k+1). The
executor runs a schedule as given, so a schedule can be printed, tested,
simulated and drawn before any TensorFlow runs. A new schedule is one
function registered in `SCHEDULES`:

    @SCHEDULES.register("my_schedule")
    def my_schedule(num_stages, num_microbatches) -> Schedule: ...
"""

import dataclasses
from typing import Dict, List, Tuple

from dist_loop.errors import UserError
from dist_loop.registry import Registry

FORWARD = "F"
BACKWARD = "B"


@dataclasses.dataclass(frozen=True)
class Action:
  """One unit of work of one stage: `F 3` or `B 3`."""

  kind: str  # FORWARD or BACKWARD
  microbatch: int

  def __str__(self) -> str:
    return f"{self.kind}{self.microbatch}"


Schedule = List[List[Action]]  # schedule[stage] = that stage's actions, in order.

SCHEDULES: Registry = Registry("pipeline schedule", "pipeline_schedule")


def F(i: int) -> Action:  # pylint: disable=invalid-name
  return Action(FORWARD, i)


def B(i: int) -> Action:  # pylint: disable=invalid-name
  return Action(BACKWARD, i)


@SCHEDULES.register("gpipe")
def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
  """GPipe: every stage runs all M forwards, then all M backwards.

  Backwards run in reverse micro-batch order, so the last micro-batch, whose
  forward finished last, starts the drain. Each stage holds the activations
  of all M micro-batches at the turn.
  """
  m = num_microbatches
  return [[F(i) for i in range(m)] + [B(i) for i in reversed(range(m))]
          for _ in range(num_stages)]


@SCHEDULES.register("1f1b")
def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
  """1F1B (PipeDream-Flush): warm up, then alternate, then drain.

  Stage k first runs min(K-k-1, M) forwards (the warm-up that fills the
  pipeline below it), then alternates one forward and one backward, and
  finishes with the remaining backwards. Stage k so holds at most K-k
  micro-batches of activations, against M for GPipe, at the same bubble.
  """
  return warmup_then_alternate(
      [min(num_stages - k - 1, num_microbatches) for k in range(num_stages)],
      num_microbatches)


def warmup_then_alternate(warmups: List[int],
                          num_microbatches: int) -> Schedule:
  """The 1F1B family: stage k runs `warmups[k]` forwards, then alternates
  one forward and one backward, then drains the remaining backwards. 1F1B
  and its variants differ only in the warm-up depths."""
  m = num_microbatches
  schedule = []
  for warmup in warmups:
    actions = [F(i) for i in range(warmup)]
    for j in range(m - warmup):
      actions += [F(warmup + j), B(j)]
    actions += [B(j) for j in range(m - warmup, m)]
    schedule.append(actions)
  return schedule


def make(name: str, num_stages: int, num_microbatches: int) -> Schedule:
  """The registered schedule `name` for (K, M), checked by `validate`."""
  schedule = SCHEDULES.get(name)(num_stages, num_microbatches)
  validate(schedule, num_stages, num_microbatches)
  return schedule


def validate(schedule: Schedule, num_stages: int,
             num_microbatches: int) -> None:
  """Raises UserError unless `schedule` is complete and can run.

  Complete: each stage runs F i and B i exactly once for every micro-batch,
  F i before B i. Runnable: following the per-stage orders with the
  cross-stage dependencies never deadlocks (checked by `simulate`).
  """
  if len(schedule) != num_stages:
    raise UserError(f"schedule has {len(schedule)} stages, expected "
                    f"{num_stages}")
  want = sorted([F(i) for i in range(num_microbatches)]
                + [B(i) for i in range(num_microbatches)], key=str)
  for k, actions in enumerate(schedule):
    if sorted(actions, key=str) != want:
      raise UserError(f"stage {k} of the schedule does not run F i and B i "
                      f"exactly once for i < {num_microbatches}: "
                      f"{' '.join(map(str, actions))}")
    for i in range(num_microbatches):
      if actions.index(B(i)) < actions.index(F(i)):
        raise UserError(f"stage {k} runs B{i} before F{i}")
  simulate(schedule)


def dependencies(stage: int, action: Action,
                 num_stages: int) -> List[Tuple[int, Action]]:
  """The (stage, action) pairs whose outputs `action` on `stage` consumes."""
  i = action.microbatch
  if action.kind == FORWARD:
    return [(stage - 1, F(i))] if stage > 0 else []
  deps = [(stage, F(i))]
  if stage < num_stages - 1:
    deps.append((stage + 1, B(i)))
  return deps


def simulate(schedule: Schedule, forward_time: float = 1.0,
             backward_time: float = 2.0
             ) -> List[List[Tuple[Action, float, float]]]:
  """Times every action as if each stage were its own device.

  An action starts when its stage's previous action and its dependencies
  have finished. Returns, per stage, (action, start, end) in stage order.
  The executor creates its ops in the order of `execution_order`, the same
  walk, so the graph can always be built.

  Raises:
    UserError: the schedule deadlocks (a stage waits for work that waits for
      it).
  """
  num_stages = len(schedule)
  done: Dict[Tuple[int, Action], float] = {}
  timeline: List[List[Tuple[Action, float, float]]] = [[] for _ in schedule]
  for stage, action in execution_order(schedule):
    start = max([timeline[stage][-1][2] if timeline[stage] else 0.0]
                + [done[d] for d in dependencies(stage, action, num_stages)])
    end = start + (forward_time if action.kind == FORWARD else backward_time)
    done[(stage, action)] = end
    timeline[stage].append((action, start, end))
  return timeline


def execution_order(schedule: Schedule) -> List[Tuple[int, Action]]:
  """All (stage, action) pairs in an order that respects every dependency
  and each stage's own order (round-robin over the stages that can go)."""
  num_stages = len(schedule)
  position = [0] * num_stages
  seen = set()
  order = []
  total = sum(len(a) for a in schedule)
  while len(order) < total:
    progressed = False
    for k in range(num_stages):
      while position[k] < len(schedule[k]):
        action = schedule[k][position[k]]
        if not all(d in seen for d in dependencies(k, action, num_stages)):
          break
        seen.add((k, action))
        order.append((k, action))
        position[k] += 1
        progressed = True
    if not progressed:
      stuck = ", ".join(f"stage {k} at {schedule[k][position[k]]}"
                        for k in range(num_stages)
                        if position[k] < len(schedule[k]))
      raise UserError(f"the pipeline schedule deadlocks: {stuck}")
  return order


def peak_activations(actions: List[Action]) -> int:
  """Most micro-batches whose forward ran but backward not yet, on a stage."""
  alive, peak = 0, 0
  for action in actions:
    alive += 1 if action.kind == FORWARD else -1
    peak = max(peak, alive)
  return peak


def bubble_formula(num_stages: int, num_microbatches: int) -> float:
  """GPipe's idle fraction (K-1)/(M+K-1), for equal stages."""
  return (num_stages - 1) / (num_microbatches + num_stages - 1)


def format_schedule(schedule: Schedule) -> str:
  """One line per stage: `stage 0: F0 F1 B0 F2 B1 ...`."""
  return "\n".join(f"stage {k}: {' '.join(map(str, actions))}"
                   for k, actions in enumerate(schedule))
