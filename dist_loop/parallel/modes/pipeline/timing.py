"""Timing chunks as the executor runs them: the seconds a plan is made from.

A `ChunkTimer` runs every chunk of a one-device schedule (`timing_row`) on
two micro-batches of real data: the first runs each chunk's F, then its I
and W in reverse; the second F, then B in reverse. It is traced and run with
per-action timestamps, so what is timed is the run's own ops, per-action
overhead and thread pools, one action at a time: a B may then use a second
core for its weight gradient while its input gradient runs, which is why B
is timed and not taken as I + W.

*Alone*, the timer runs on one device with the others idle. *Crowded*, the
same one-device pipeline runs on several devices at once, each a replica of
the executor: beside other work an action has no core to spare and shares
the memory. `measure_chunks` gives both; the simulator uses the crowded
times while other actions run (`simulator.py`).

With `--jit_compile` the timer's chunks are compiled as the run's are
(`chunk.py`: F one XLA computation, B its gradient), so the plan is made
from what will run. A compiled chunk's backward cannot be split: the timer
then runs one micro-batch, F then B, and a chunk's I is its whole B and its
W nothing (no schedule that splits B is a candidate).
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dist_loop.parallel.modes.pipeline.action import B, F, I, W, Action
from dist_loop.parallel.modes.pipeline.schedule import Schedule

# Per chunk: (F, I, W, B) seconds of one micro-batch.
ChunkSeconds = Tuple[float, float, float, float]


def timing_row(num_chunks: int, backward: bool = True,
               jit_compile: bool = False) -> List[Action]:
  """The actions a `ChunkTimer` runs on its one device, in order.

  Micro-batch 0: every chunk's F, then each chunk's I and W, last chunk
  first. With `backward`, micro-batch 1: every F again, then each B.
  With `jit_compile`: micro-batch 0's F, then each B.
  """
  back = list(reversed(range(num_chunks)))
  forward = [F(0, c) for c in range(num_chunks)]
  if jit_compile:
    return forward + [B(0, c) for c in back]
  row = forward + [a for c in back for a in (I(0, c), W(0, c))]
  if backward:
    row += [F(1, c) for c in range(num_chunks)] + [B(1, c) for c in back]
  return row


class ChunkTimer:
  """`chunks` as a one-device pipeline, replicated on each of `devices`
  (all at once), with every action timed."""

  def __init__(self, chunks: Sequence[Sequence[object]], x, y, task,
               devices: Sequence[str], recompute: str = "never",
               backward: bool = True, jit_compile: bool = False):
    """Args:
      chunks: the model's built layers, cut into consecutive chunks.
      x, y: one micro-batch of the training data.
      task: the run's task (the last chunk's loss).
      devices: where to run: one replica of the pipeline on each.
      recompute: one of `options.RECOMPUTE` (I and B then run F again).
      backward: also time B (else only micro-batch 0 runs: F, I, W).
      jit_compile: the chunks compiled as the run's (`timing_row`).
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from dist_loop.parallel.modes.pipeline.executor import PipelineExecutor  # pylint: disable=g-import-not-at-top
    n = len(chunks)
    self.row = timing_row(n, backward, jit_compile)
    self.devices = list(devices)
    m = 1 + max(a.microbatch for a in self.row)
    self.executor = PipelineExecutor(
        chunks, Schedule.of([self.row], [0] * n), [[d] for d in devices], m,
        task, m * len(devices) * len(x), recompute, jit_compile)
    self.step = tf.function(
        lambda x, y: self.executor.step(x, y, timed=True), autograph=False)
    self.inputs = (tf.concat([x] * (m * len(devices)), 0),
                   tf.concat([y] * (m * len(devices)), 0))

  def durations(self) -> np.ndarray:
    """Runs one step: seconds of each action, [devices, len(row)]."""
    out = self.step(*self.inputs)
    return (out["ends"] - out["starts"]).numpy()[:, 0]


def chunk_seconds(row: Sequence[Action], durations: np.ndarray
                  ) -> List[ChunkSeconds]:
  """Each chunk's (F, I, W, B) from timed runs of `row`.

  Args:
    row: the timed actions (`timing_row`).
    durations: [..., len(row)] seconds (runs, devices); the median over
      everything but the last axis is kept. Without a B in `row`, B is
      taken as I + W; without I and W (compiled), I is B and W is 0.
  """
  seconds = np.median(np.reshape(durations, (-1, len(row))), axis=0)
  at = {a: float(seconds[j]) for j, a in enumerate(row)}
  out = []
  for c in sorted({a.chunk for a in row}):
    if I(0, c) not in at:
      out.append((at[F(0, c)], at[B(0, c)], 0.0, at[B(0, c)]))
      continue
    i, w = at[I(0, c)], at[W(0, c)]
    out.append((at[F(0, c)], i, w, at.get(B(1, c), i + w)))
  return out


def measure_chunks(chunks: Sequence[Sequence[object]], x, y, task,
                   devices: Sequence[str], recompute: str = "never",
                   repeats: int = 5, backward: bool = True,
                   jit_compile: bool = False
                   ) -> Tuple[List[ChunkSeconds], Optional[List[ChunkSeconds]]]:
  """F, I, W and B seconds of each chunk: (alone, crowded).

  Alone runs on `devices[0]` with the other devices idle; crowded runs the
  same actions on every device of `devices` at once (None for one device).
  `repeats` timed runs follow one that traces; the arguments are
  `ChunkTimer`'s.
  """
  def timed(on):
    timer = ChunkTimer(chunks, x, y, task, on, recompute, backward,
                       jit_compile)
    timer.durations()  # Traces: not timed.
    return chunk_seconds(timer.row, np.stack(
        [timer.durations() for _ in range(repeats)]))

  return timed(devices[:1]), timed(devices) if len(devices) > 1 else None


def chunk_measurer(layers, dataset, microbatch: int, task,
                   devices: Sequence[str], recompute: str, cores: float,
                   jit_compile: bool = False
                   ) -> Callable[[Sequence[int]], tuple]:
  """bounds -> `measure_chunks` of layers [bounds[c], bounds[c+1]), with
  each distinct cut measured once: crowded on as many of `devices` at once
  as run without sharing a core (`cores`: `costs.shared_cores`); compiled
  with `jit_compile`."""
  devices = devices[:int(min(cores, len(devices)))]
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x = tf.constant(dataset.train_x[:microbatch])
  y = tf.constant(dataset.train_y[:microbatch])
  cache: Dict[Tuple[int, ...], tuple] = {}

  def measure(bounds):
    key = tuple(bounds)
    if key not in cache:
      cache[key] = measure_chunks(
          [layers[a:b] for a, b in zip(key, key[1:])], x, y, task, devices,
          recompute, jit_compile=jit_compile)
    return cache[key]
  return measure
