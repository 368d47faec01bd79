"""One action of a pipeline schedule, and the data it waits for.

An action works on one (chunk, micro-batch):

* `F`: the chunk's forward;
* `I`: the input gradient: the gradient sent to the previous chunk, and the
  gradients at the points where the weights join the data (kept for W);
* `W`: the chunk's weight gradients, from what I kept;
* `B`: the whole backward, I then W in one action.

The dependencies between actions are implied by their kinds and are the
same for every schedule, so they live here, beside the action, rather than
in any schedule: F of chunk c needs F of chunk c-1; I or B of chunk c needs
its F and the I or B of chunk c+1; W needs its I. The executor, the
simulator and the deadlock check (`schedule.execution_order`) all read
them from `needs` and `provides`.
"""

import dataclasses
from typing import List, Tuple

FORWARD = "F"
BACKWARD = "B"
INPUT_GRAD = "I"
WEIGHT_GRAD = "W"
KINDS = (FORWARD, INPUT_GRAD, WEIGHT_GRAD, BACKWARD)

# What finishing an action makes available: ("F", c, i) the activations of
# chunk c; ("G", c, i) the gradient chunk c sends to chunk c-1; ("W", c, i)
# chunk c's weight gradients.
Key = Tuple[str, int, int]


@dataclasses.dataclass(frozen=True)
class Action:
  """One unit of work: `F 3` of a chunk. `chunk` -1 means the chunk of the
  device whose list holds it (one-chunk schedules written per device)."""

  kind: str  # One of KINDS.
  microbatch: int
  chunk: int = -1

  def __str__(self) -> str:
    return f"{self.kind}{self.microbatch}"


def F(i: int, chunk: int = -1) -> Action:  # pylint: disable=invalid-name
  return Action(FORWARD, i, chunk)


def B(i: int, chunk: int = -1) -> Action:  # pylint: disable=invalid-name
  return Action(BACKWARD, i, chunk)


def I(i: int, chunk: int = -1) -> Action:  # pylint: disable=invalid-name
  return Action(INPUT_GRAD, i, chunk)


def W(i: int, chunk: int = -1) -> Action:  # pylint: disable=invalid-name
  return Action(WEIGHT_GRAD, i, chunk)


def provides(action: Action) -> List[Key]:
  """What finishing `action` makes available."""
  c, i = action.chunk, action.microbatch
  return {FORWARD: [("F", c, i)], INPUT_GRAD: [("G", c, i)],
          WEIGHT_GRAD: [("W", c, i)],
          BACKWARD: [("G", c, i), ("W", c, i)]}[action.kind]


def needs(action: Action, num_chunks: int) -> List[Key]:
  """What `action` waits for, in a model of `num_chunks` chunks."""
  c, i = action.chunk, action.microbatch
  if action.kind == FORWARD:
    return [("F", c - 1, i)] if c > 0 else []
  if action.kind == WEIGHT_GRAD:
    return [("G", c, i)]
  return [("F", c, i)] + ([("G", c + 1, i)] if c < num_chunks - 1 else [])
