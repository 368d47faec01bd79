"""Planning a pipeline run: which schedule, which chunks, from measured costs.

`plan(config, dataset, devices)` is everything a run decides before its
placed model is built: it builds the model once unplaced (a *probe*: the
chunks are only known after measuring the layers, which needs them built),
measures the layers' costs on one micro-batch (`costs.py`), makes the
candidates and picks one. The trainer then builds the model with each
chunk's layers on its device and gives it the probe's initial weights:
those are what the sync mode starts from, since the probe was built first
after seeding.

For a named schedule the only candidate is that schedule, cut into its
chunks; for `--pipeline_schedule=auto` every registered schedule that can
run (K, M, V) is one. Each candidate is partitioned into its own chunks (C
= K*V), given its chunks' costs (timed as chunks when the run measures
traced costs, `timing.py`, compiled as the run's with `--jit_compile`
and timed from the host under `--deterministic`, else summed from the
layers'), and simulated
(`simulator.py`) on the cores the devices share. Auto picks the fastest
predicted step among the candidates whose predicted peak activation memory
per device fits `--pipeline_memory_mb` (all of them without a budget), and
the table of candidates goes to the log.

What is chosen from timings (auto's schedule, a split balanced by measured
time) can differ between two runs, or a run and its resume (which plans
again), when candidates are predicted close: timings are wall-clock, even
under `--deterministic`. Another schedule or split sums the same gradients
in another order, so under `--deterministic` the log names the flags that
pin the plan (`pinning`).
"""

import dataclasses
import math
from typing import Callable, List, Optional, Sequence, Tuple

import keras
import numpy as np
from absl import logging

from dist_loop import models, tasks
from dist_loop.core.errors import UserError
from dist_loop.parallel.modes.base import require_decided_xla
from dist_loop.parallel.modes.pipeline import costs as costs_lib
from dist_loop.parallel.modes.pipeline import partition
from dist_loop.parallel.modes.pipeline import schedule as schedule_lib
from dist_loop.parallel.modes.pipeline import simulator, timing


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A schedule, its chunks, their costs and its predicted step."""

  name: str
  schedule: schedule_lib.Schedule
  spans: List[partition.ChunkSpan]  # One per chunk.
  split_how: str
  costs: simulator.ChunkCosts
  prediction: simulator.Prediction


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a pipeline run trains with, decided before the placed build."""

  chosen: Candidate
  candidates: Tuple[Candidate, ...]  # Every one, as predicted.
  skipped: Tuple[Tuple[str, str], ...]  # (name, why it cannot run).
  # The probe's; None once the placed model has them.
  initial_weights: Optional[List[np.ndarray]]


def plan(config, dataset, devices: Sequence[str],
         traced: bool = True) -> Plan:
  """Measures the run's model and picks its schedule and chunks.

  Args:
    config: the run's `Config` (`mode_options` a `PipelineOptions`).
    dataset: the training data; one micro-batch of it is timed.
    devices: the run's devices; the first K (replica 0's) are timed on.
    traced: time as the executor runs (`timing.py`; with
      `config.jit_compile` the compiled chunks; with
      `config.deterministic`, which refuses timestamps, from the host);
      else time each layer eagerly: rougher, quicker to start, not
      compiled.

  Returns:
    The plan.

  Raises:
    UserError: no candidate can run, or none fits `--pipeline_memory_mb`.
  """
  require_decided_xla(config)
  options = config.mode_options
  k, m = options.num_stages, options.num_microbatches
  replicas = len(devices) // k
  microbatch = config.global_batch_size // replicas // m
  task = tasks.for_dataset(dataset)
  probe = models.build_for(config, dataset)
  layers = probe.layers
  input_dtype = getattr(models.MODELS.get(config.model), "input_dtype",
                        "float32")
  layer_costs = costs_lib.measure(layers, dataset, microbatch, input_dtype,
                                  task, devices[0], traced=traced,
                                  jit_compile=config.jit_compile,
                                  host_timed=config.deterministic)
  cores = costs_lib.shared_cores(devices, config.intra_op_threads,
                                 config.inter_op_threads, replicas)
  measure = (timing.chunk_measurer(layers, dataset, microbatch, task,
                                   devices[:k], options.recompute, cores,
                                   config.jit_compile, config.deterministic)
             if traced else None)
  candidates, skipped = make_candidates(
      options, layers, layer_costs,
      lambda c: models.split_points_for(config.model, c, len(layers)),
      measure=measure, cores=cores, jit_compile=config.jit_compile)
  chosen = pick(candidates, options.pipeline_memory_mb)
  logging.info("pipeline schedules, predicted from the measured costs:\n%s",
               table(candidates, chosen, skipped))
  pin = pinning(options, chosen)
  if config.deterministic and pin:
    logging.warning(
        "--deterministic: this pipeline's plan was chosen from measured "
        "times, and another run or a resume may choose another, which sums "
        "the same gradients in another order; to train the same in every "
        "run, pass %s", pin)
  if m < k:
    logging.warning(
        "--num_microbatches=%d < --num_stages=%d: the bubble (K-1)/(M+K-1) "
        "is %.0f%% of each step; use M >= 4K (--num_microbatches=%d)", m, k,
        100 * schedule_lib.bubble_formula(k, m), 4 * k)
  if any(isinstance(l, keras.layers.BatchNormalization) for l in layers):
    logging.warning(
        "the model has BatchNormalization: in pipeline mode its batch "
        "statistics are per micro-batch (%d examples), not per mini-batch, "
        "and its moving averages are updated once per micro-batch",
        microbatch)
  return Plan(chosen, tuple(candidates), tuple(skipped), probe.get_weights())


def make_candidates(
    options, layers, layer_costs: Sequence[costs_lib.LayerCost],
    declared: Callable[[int], Optional[Sequence[int]]],
    measure: Optional[Callable[[Sequence[int]], tuple]] = None,
    cores: float = math.inf, jit_compile: bool = False
) -> Tuple[List[Candidate], List[Tuple[str, str]]]:
  """The run's schedule as a candidate, or every schedule for auto.

  Args:
    options: the run's `PipelineOptions`.
    layers: the model's built layers.
    layer_costs: their measured costs.
    declared: C -> the model's own split points for C chunks, or None.
    measure: chunk bounds -> their measured (alone, crowded) seconds
      (`timing.chunk_measurer`); None: the layers' sums.
    cores: `costs.shared_cores`.
    jit_compile: auto skips the schedules that split the backward (a
      named one was refused at parse time, `validation.py`).

  Returns:
    (candidates, skipped): for auto, the schedules that cannot run
    (K, M, V) as (name, reason).

  Raises:
    UserError: the named schedule cannot run this model and (K, M, V).
  """
  k, m = options.num_stages, options.num_microbatches
  auto = options.pipeline_schedule == schedule_lib.AUTO
  names = (schedule_lib.SCHEDULES.names() if auto
           else [options.pipeline_schedule])
  seconds = [c.forward + c.backward for c in layer_costs]
  candidates, skipped = [], []
  for name in names:
    v = options.virtual_stages
    if auto and not schedule_lib.takes_virtual_stages(name):
      v = 0
    try:
      schedule = schedule_lib.make(name, k, m, v)
      chunks = schedule.num_chunks
      why = (f"--pipeline_schedule={name} ({k} devices x "
             f"{schedule.virtual_stages} chunks)")
      if jit_compile and schedule_lib.splits_backward(schedule):
        raise UserError("splits the backward, which --jit_compile cannot "
                        "compile")
      spans, how = partition.choose(
          options.stage_split, layers, chunks, options.split_points,
          declared(chunks), seconds, why if chunks != k else "")
    except UserError as e:
      if not auto:
        raise
      skipped.append((name, str(e)))
      continue
    bounds = [s.start for s in spans] + [spans[-1].end]
    chunk_costs = costs_lib.for_chunks(
        layer_costs, bounds, options.recompute,
        measure(bounds) if measure else None, cores)
    candidates.append(Candidate(name, schedule, spans, how, chunk_costs,
                                simulator.simulate(schedule, chunk_costs)))
  return candidates, skipped


def pinning(options, chosen: Candidate) -> str:
  """The flags that give `chosen` without timings ("" if its flags already
  do): its schedule for auto, its split points for a split balanced by
  measured time."""
  flags = []
  if options.pipeline_schedule == schedule_lib.AUTO:
    flags.append(f"--pipeline_schedule={chosen.name}")
  if chosen.split_how == partition.BY_TIME:
    points = ",".join(str(s.start) for s in chosen.spans[1:])
    flags += ["--stage_split=explicit", f"--split_points={points}"]
  return " ".join(flags)


def pick(candidates: Sequence[Candidate], memory_mb: float = 0.0
         ) -> Candidate:
  """The fastest predicted candidate whose peak memory fits `memory_mb` (MB
  per device; 0: any).

  Raises:
    UserError: there is no candidate, or none fits the budget.
  """
  if not candidates:
    raise UserError("no registered pipeline schedule can run this model "
                    "with these --num_stages, --num_microbatches and "
                    "--virtual_stages; name one with --pipeline_schedule")
  fits = [p for p in candidates
          if not memory_mb or p.prediction.peak_mb <= memory_mb]
  if not fits:
    least = min(candidates, key=lambda p: p.prediction.peak_mb)
    raise UserError(
        f"no pipeline schedule is predicted to fit --pipeline_memory_mb="
        f"{memory_mb:g}; the least is {least.prediction.peak_mb:.1f} MB "
        f"({least.name}): raise --pipeline_memory_mb, use --recompute=always"
        ", or more --num_stages")
  return min(fits, key=lambda p: (p.prediction.step_time, p.name))


def table(candidates: Sequence[Candidate], chosen: Optional[Candidate] = None,
          skipped: Sequence[Tuple[str, str]] = ()) -> str:
  """The candidates as a text table; `*` marks the chosen one."""
  lines = ["  schedule            V   step ms  bubble  live/device  "
           "peak MB/device"]
  for p in sorted(candidates, key=lambda p: p.prediction.step_time):
    mark = "*" if p is chosen else " "
    pred = p.prediction
    lines.append(f"{mark} {p.name:<18} {p.schedule.virtual_stages:>2} "
                 f"{pred.step_time * 1e3:>8.2f} {pred.bubble:>7.3f} "
                 f"{max(pred.peak_live):>12} {pred.peak_mb:>15.2f}")
  for name, reason in skipped:
    lines.append(f"  {name:<18} not a candidate: {reason}")
  return "\n".join(lines)
