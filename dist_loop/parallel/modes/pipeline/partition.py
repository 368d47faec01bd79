"""Cutting a model's ordered layer list into C contiguous chunks.

A schedule runs C = K*V chunks (V per device; V=1 for GPipe and 1F1B, where
each device holds one chunk). A partition is a list of split points: the
layer indices where chunks 1..C-1 start (`--split_points=2,4` gives layers
[0,2), [2,4), [4,L)). Three ways to choose them (`--stage_split`):

* explicit: the user's `--split_points`;
* params: balance the parameter count of the chunks;
* auto: the model's own split if its builder declares one for C (the seed
  CNN: conv+pool | flatten+dense+dense), else balance the measured time of
  each layer's forward and backward on one micro-batch (`costs.py`).

Balancing is the linear-partition problem: choose the cuts that minimise the
largest chunk, solved exactly by dynamic programming over (layers, chunks).
"""

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np

from dist_loop.core.errors import UserError

# How a split balanced by measured time is named (`choose`): the one split
# that depends on the timing.
BY_TIME = "measured time"


@dataclasses.dataclass(frozen=True)
class ChunkSpan:
  """Layers [start, end) of the model: which layers form chunk `index`."""

  index: int
  start: int
  end: int
  layer_names: Tuple[str, ...]
  params: int
  seconds: float  # Measured forward+backward time of one micro-batch.


def parse_split_points(text: str) -> List[int]:
  """`"2,4"` -> [2, 4]. Raises UserError on anything but integers."""
  try:
    return [int(p) for p in text.replace(" ", "").split(",") if p]
  except ValueError:
    raise UserError(f"--split_points={text!r} must be comma-separated layer "
                    "indices, e.g. 2,4") from None


def check_split_points(points: Sequence[int], num_chunks: int,
                       num_layers: int, why: str = "") -> None:
  """Raises UserError unless `points` cut `num_layers` into `num_chunks`.

  `why` says where the chunk count comes from (default: --num_stages).
  """
  points = list(points)
  if len(points) != num_chunks - 1:
    why = why or f"--num_stages={num_chunks}"
    raise UserError(f"--split_points={','.join(map(str, points))} gives "
                    f"{len(points) + 1} chunks but {why} needs {num_chunks};"
                    f" give {num_chunks - 1} layer indices")
  bad = [p for p in points if not 1 <= p <= num_layers - 1]
  if bad:
    raise UserError(f"--split_points {bad} out of range: the model has "
                    f"{num_layers} layers, so split points must be in "
                    f"1..{num_layers - 1}")
  if any(b <= a for a, b in zip(points, points[1:])):
    raise UserError(f"--split_points={','.join(map(str, points))} must be "
                    "strictly increasing")


def balance(costs: Sequence[float], num_chunks: int) -> List[int]:
  """Split points that minimise the largest chunk's summed cost.

  Args:
    costs: one non-negative cost per layer, in order.
    num_chunks: C, at most len(costs).

  Returns:
    C-1 increasing split points; every chunk has at least one layer.
  """
  n = len(costs)
  prefix = np.concatenate([[0.0], np.cumsum(costs)])
  inf = float("inf")
  # best[k][j]: the smallest max-chunk cost of layers [0, j) in k chunks.
  best = np.full((num_chunks + 1, n + 1), inf)
  cut = np.zeros((num_chunks + 1, n + 1), dtype=int)
  best[0][0] = 0.0
  for k in range(1, num_chunks + 1):
    for j in range(k, n + 1):
      for i in range(k - 1, j):
        value = max(best[k - 1][i], prefix[j] - prefix[i])
        # Ties go to the later cut, so earlier chunks take more layers and
        # parameter-free layers (flatten, pool) stay with what feeds them.
        if value <= best[k][j]:
          best[k][j], cut[k][j] = value, i
  points, j = [], n
  for k in range(num_chunks, 1, -1):
    j = cut[k][j]
    points.append(int(j))
  return sorted(points)


def layer_params(layer) -> int:
  return int(sum(np.prod(v.shape) for v in layer.trainable_variables))


def choose(method: str, layers, num_chunks: int, split_points_text: str,
           declared: Optional[Sequence[int]], seconds: Sequence[float],
           why: str = "") -> Tuple[List[ChunkSpan], str]:
  """Cuts `layers` into chunks as `--stage_split` says.

  Args:
    method: "auto", "params" or "explicit".
    layers: the model's built layers, in order.
    num_chunks: C, the schedule's chunks.
    split_points_text: `--split_points`, for "explicit".
    declared: the model's own split points for C
      (`models.split_points_for`), or None.
    seconds: each layer's measured forward+backward time (`costs.py`).
    why: where C comes from, for messages (default: --num_stages).

  Returns:
    The chunks' spans, and how the split was chosen (for the log).

  Raises:
    UserError: the split points do not cut the model into C chunks.
  """
  n = len(layers)
  if num_chunks > n:
    raise UserError(f"{why or f'--num_stages={num_chunks}'} needs "
                    f"{num_chunks} chunks of layers but the model has only "
                    f"{n} layers; use fewer stages")
  params = [layer_params(layer) for layer in layers]
  if method == "explicit":
    points, how = parse_split_points(split_points_text), "explicit"
  elif method == "params":
    # A small epsilon per layer keeps parameter-free layers from being free.
    points, how = balance([p + 1e-3 for p in params], num_chunks), "params"
  elif declared is not None:
    points, how = list(declared), "the model's own split"
  else:
    points, how = balance(seconds, num_chunks), BY_TIME
  check_split_points(points, num_chunks, n, why)
  bounds = [0] + list(points) + [n]
  spans = []
  for c in range(num_chunks):
    part = slice(bounds[c], bounds[c + 1])
    spans.append(ChunkSpan(c, bounds[c], bounds[c + 1],
                           tuple(layer.name for layer in layers[part]),
                           sum(params[part]), sum(seconds[part])))
  return spans, how


def format_partition(spans: Sequence[ChunkSpan],
                     devices: Sequence[str]) -> str:
  """A table of the chunks: device, layers, parameters, measured time.

  Args:
    spans: the chunks' spans.
    devices: each chunk's device.
  """
  lines = []
  for s in spans:
    lines.append(f"  chunk {s.index} on {devices[s.index]}: layers "
                 f"[{s.start}, {s.end}) {', '.join(s.layer_names)}; "
                 f"{s.params:,} params; {s.seconds * 1e3:.2f} ms/micro-batch")
  return "\n".join(lines)
