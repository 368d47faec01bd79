"""Shared pieces of the benchmarks: trainers, side-by-side timing, tables.

The machines are shared and noisy, so a benchmark never reports a time on
its own: it times every variant in the same process, interleaved round by
round (A B C, A B C, ...), takes each variant's median, and reports ratios.

A benchmark builds its trainers as a run does (`trainer`): the flat flag
values become a validated Config, and the mode's registered Trainer is
built for one local process.
"""

import statistics
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import dist_loop
from dist_loop import configure, data, models
from dist_loop.control.evaluation import Evaluator
from dist_loop.data import Dataset
from dist_loop.parallel.modes import Trainer, build_trainer
from dist_loop.runtime.cluster import Cluster

# One process, whatever TF_CONFIG says: a benchmark is not a cluster.
LOCAL = Cluster()


def load_data(run: dist_loop.Config) -> Dataset:
  """The run's dataset, images at the size its model wants."""
  return data.load(run, models.image_size_for(run.model))


def config(**flat) -> dist_loop.Config:
  """A validated Config of one local process from flat flag values."""
  return configure.validate(
      dist_loop.make_config(workdir="/tmp/unused", **flat), LOCAL)


def trainer(devices: Sequence[str], flat: Mapping[str, object],
            dataset: Optional[Dataset] = None
            ) -> Tuple[dist_loop.Config, Trainer]:
  """The Config of `flat` and its mode's Trainer on `devices`.

  Args:
    devices: the devices to train on (`dist_loop.runtime.devices.configure`).
    flat: flag values, as `dist_loop.make_config` takes them.
    dataset: the loaded dataset, to share one among variants; None loads
      the Config's.
  """
  run = config(**flat)
  dataset = load_data(run) if dataset is None else dataset
  return run, build_trainer(run, list(devices), dataset, LOCAL)


class ChunkedRun:
  """A trainer trained `chunk` steps at a time and evaluated after each
  chunk, so that several can take turns in one process: the chunks'
  seconds (the first, which traces, excluded), the accuracy, and the steps
  and seconds it took to reach a target accuracy."""

  def __init__(self, trainer: Trainer, dataset: Dataset, eval_batch_size: int,
               chunk: int):
    self.trainer, self.chunk = trainer, chunk
    self.evaluator = Evaluator(trainer.model, dataset, eval_batch_size)
    self.steps = 0
    self.chunk_seconds: List[float] = []
    self.steps_to_target: Optional[int] = None
    self.seconds_to_target: Optional[float] = None  # Timed chunks only.
    self.accuracy = 0.0

  def train_chunk(self, target: float) -> None:
    t0 = time.perf_counter()
    self.trainer.train(self.chunk)
    seconds = time.perf_counter() - t0
    if self.steps:  # The first chunk traces: not timed.
      self.chunk_seconds.append(seconds)
    self.steps += self.chunk
    self.accuracy = self.evaluator.evaluate()["eval/accuracy"]
    if self.steps_to_target is None and self.accuracy >= target:
      self.steps_to_target = self.steps
      self.seconds_to_target = sum(self.chunk_seconds)


def interleaved_times(variants: Dict[str, Callable[[], None]], rounds: int,
                      clock: Callable[[], float] = time.perf_counter
                      ) -> Dict[str, List[float]]:
  """Seconds of each callable in every round, timed in interleaved rounds."""
  times = {name: [] for name in variants}
  for _ in range(rounds):
    for name, fn in variants.items():
      t0 = clock()
      fn()
      times[name].append(clock() - t0)
  return times


def interleaved_medians(variants: Dict[str, Callable[[], None]],
                        rounds: int,
                        clock: Callable[[], float] = time.perf_counter
                        ) -> Dict[str, float]:
  """Median seconds of each callable, timed in interleaved rounds."""
  return {name: statistics.median(ts) for name, ts in
          interleaved_times(variants, rounds, clock).items()}


def spread(values: Sequence[float], fmt: str = "{:.3g}") -> str:
  """'min-max' of `values`, for a median's column beside it."""
  return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def markdown_table(rows: List[Dict], columns: Sequence[str]) -> str:
  """Rows of dicts as a markdown table; floats get 3 significant digits."""

  def cell(v):
    if isinstance(v, float):
      return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "" if v is None else str(v)

  lines = ["| " + " | ".join(columns) + " |",
           "| " + " | ".join("---" for _ in columns) + " |"]
  lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |"
            for r in rows]
  return "\n".join(lines)
