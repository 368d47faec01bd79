"""Which schedule a run uses, predicted from the measured costs.

For a named schedule the plan is that schedule, cut into its chunks; for
`--pipeline_schedule=auto` every registered schedule that can run (K, M, V)
is a candidate. Each candidate is partitioned into its own chunks (C =
K*V), given its chunks' costs (measured as chunks when the run measures
traced costs, else summed from the layers': `costs.py`), and simulated
(`simulator.py`) on the cores the devices share. Auto picks the fastest predicted step among
the candidates whose predicted peak activation memory per device fits
`--pipeline_memory_mb` (all of them without a budget), and the table of
candidates goes to the log.
"""

import dataclasses
import math
from typing import Callable, List, Optional, Sequence, Tuple

from dist_loop.errors import UserError
from dist_loop.modes.pipeline import costs as costs_lib
from dist_loop.modes.pipeline import partition
from dist_loop.modes.pipeline import schedule as schedule_lib
from dist_loop.modes.pipeline import simulator


@dataclasses.dataclass(frozen=True)
class Plan:
  """A schedule, its chunks, their costs and its predicted step."""

  name: str
  schedule: schedule_lib.Schedule
  stages: List[partition.Stage]  # One per chunk.
  split_how: str
  costs: simulator.ChunkCosts
  prediction: simulator.Prediction


def make_plans(options, layers, layer_costs: Sequence[costs_lib.LayerCost],
               declared: Callable[[int], Optional[Sequence[int]]],
               measure: Optional[Callable[[Sequence[int]], list]] = None,
               cores: float = math.inf
               ) -> Tuple[List[Plan], List[Tuple[str, str]]]:
  """The plans of the run's schedule, or of every candidate for auto.

  Args:
    options: the run's `PipelineOptions`.
    layers: the model's built layers.
    layer_costs: their measured costs.
    declared: C -> the model's own split points for C chunks, or None.
    measure: chunk bounds -> their measured (alone, crowded) seconds
      (`costs.chunk_measurer`); None: the layers' sums.
    cores: `costs.shared_cores`.

  Returns:
    (plans, skipped): for auto, the candidates that cannot run (K, M, V)
    as (name, reason).

  Raises:
    UserError: the named schedule cannot run this model and (K, M, V).
  """
  k, m = options.num_stages, options.num_microbatches
  auto = options.pipeline_schedule == schedule_lib.AUTO
  names = (schedule_lib.SCHEDULES.names() if auto
           else [options.pipeline_schedule])
  seconds = [c.forward + c.backward for c in layer_costs]
  plans, skipped = [], []
  for name in names:
    v = options.virtual_stages
    if auto and not schedule_lib.takes_virtual_stages(name):
      v = 0
    try:
      schedule = schedule_lib.make(name, k, m, v)
      chunks = schedule.num_chunks
      why = (f"--pipeline_schedule={name} ({k} devices x "
             f"{schedule.virtual_stages} chunks)")
      stages, how = partition.choose(
          options.stage_split, layers, chunks, options.split_points,
          declared(chunks), seconds, why if chunks != k else "")
    except UserError as e:
      if not auto:
        raise
      skipped.append((name, str(e)))
      continue
    bounds = [s.start for s in stages] + [stages[-1].end]
    chunk_costs = costs_lib.for_chunks(
        layer_costs, bounds, options.recompute,
        measure(bounds) if measure else None, cores)
    plans.append(Plan(name, schedule, stages, how, chunk_costs,
                      simulator.simulate(schedule, chunk_costs)))
  return plans, skipped


def pick(plans: Sequence[Plan], memory_mb: float = 0.0) -> Plan:
  """The fastest predicted plan whose peak memory fits `memory_mb` (MB per
  device; 0: any).

  Raises:
    UserError: there is no plan, or none fits the budget.
  """
  if not plans:
    raise UserError("no registered pipeline schedule can run this model "
                    "with these --num_stages, --num_microbatches and "
                    "--virtual_stages; name one with --pipeline_schedule")
  fits = [p for p in plans
          if not memory_mb or p.prediction.peak_mb <= memory_mb]
  if not fits:
    least = min(plans, key=lambda p: p.prediction.peak_mb)
    raise UserError(
        f"no pipeline schedule is predicted to fit --pipeline_memory_mb="
        f"{memory_mb:g}; the least is {least.prediction.peak_mb:.1f} MB "
        f"({least.name}): raise --pipeline_memory_mb, use --recompute=always"
        ", or more --num_stages")
  return min(fits, key=lambda p: (p.prediction.step_time, p.name))


def table(plans: Sequence[Plan], chosen: Optional[Plan] = None,
          skipped: Sequence[Tuple[str, str]] = ()) -> str:
  """The candidates as a text table; `*` marks the chosen one."""
  lines = ["  schedule            V   step ms  bubble  live/device  "
           "peak MB/device"]
  for p in sorted(plans, key=lambda p: p.prediction.step_time):
    mark = "*" if p is chosen else " "
    pred = p.prediction
    lines.append(f"{mark} {p.name:<18} {p.schedule.virtual_stages:>2} "
                 f"{pred.step_time * 1e3:>8.2f} {pred.bubble:>7.3f} "
                 f"{max(pred.peak_live):>12} {pred.peak_mb:>15.2f}")
  for name, reason in skipped:
    lines.append(f"  {name:<18} not a candidate: {reason}")
  return "\n".join(lines)
