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
W nothing (no schedule that splits B is a candidate). Compiled chunks are
timed alone only: the layers' variables are on the first device, and the
crowded replicas on the others would read them from there, which a
compiled function cannot (as data-parallel pipelines cannot compile,
`validation.py`); the simulator then takes the alone times throughout.

Op determinism (`--deterministic`) refuses the timestamp op. A `HostTimer`
then times the same chunks, built by the same executor (compiled with
`--jit_compile`), from the host: each action is the difference between two
traced calls, timed from the call to its fetched result, of the chunk's
actions up to it and of those before it (F; F, I; F, I, W; F, B). The
timestamps are kept where they are allowed because they are more precise:
they time each action inside one step, while a difference of two calls
carries the noise of both calls and of their dispatch, which can be as
long as a small chunk's action, and crowded, the host sees only when the
slowest device ends.
"""

import functools
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dist_loop.parallel.modes.pipeline.action import (BACKWARD, FORWARD,
                                                      INPUT_GRAD, KINDS,
                                                      WEIGHT_GRAD, B, F, I,
                                                      W, Action)
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


# The actions a `HostTimer` call runs to time one kind: the chunk's actions
# on one micro-batch up to it. Without its last, the call it is compared to.
_UP_TO = {FORWARD: (FORWARD,), INPUT_GRAD: (FORWARD, INPUT_GRAD),
          WEIGHT_GRAD: (FORWARD, INPUT_GRAD, WEIGHT_GRAD),
          BACKWARD: (FORWARD, BACKWARD)}


class HostTimer(ChunkTimer):
  """A `ChunkTimer`'s chunks and actions, timed from the host, without
  timestamps (see the module docstring)."""

  def __init__(self, chunks: Sequence[Sequence[object]], x, y, task,
               devices: Sequence[str], recompute: str = "never",
               backward: bool = True, jit_compile: bool = False):
    """Args: `ChunkTimer`'s."""
    super().__init__(chunks, x, y, task, devices, recompute, backward,
                     jit_compile)
    self.x, self.y = x, y
    self.functions = {}  # (chunk, actions) -> its traced call.

  def durations(self) -> np.ndarray:
    """Makes each chunk's calls once: seconds of each action of the row,
    [1, len(row)] (the devices run at once, and the host sees when the
    last one ends). The chunks run forward, then backward from the last,
    each on the real data the one before it sent."""
    backward = [k for k in KINDS if k != FORWARD and k in
                {a.kind for a in self.row}]
    calls, inputs, sent = {}, [], [self.x, None]
    for c in range(len(self.executor.chunks)):
      inputs.append(sent)
      calls[(c, ())], _ = self._timed(c, (), sent, None)
      calls[(c, _UP_TO[FORWARD])], sends = self._timed(
          c, _UP_TO[FORWARD], sent, None)
      sent = sends.get("F")
    grads = None  # The last chunk's backward starts from its loss.
    for c in reversed(range(len(self.executor.chunks))):
      to_send = None
      for kind in backward:
        calls[(c, _UP_TO[kind])], sends = self._timed(
            c, _UP_TO[kind], inputs[c], grads)
        to_send = to_send or sends.get("G")
      grads = to_send
    # A difference is noisy: an action shorter than the noise may be < 0.
    return np.array([[max(calls[(a.chunk, _UP_TO[a.kind])]
                          - calls[(a.chunk, _UP_TO[a.kind][:-1])], 0.0)
                      for a in self.row]])

  def _timed(self, c: int, actions: Tuple[str, ...], inputs, grads):
    """Seconds of one call of chunk c's `actions`, and what it sent."""
    key = (c, actions)
    if key not in self.functions:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      self.functions[key] = tf.function(
          functools.partial(self._actions, c, actions), autograph=False)
    start = time.perf_counter()
    ends, sends = self.functions[key](inputs, grads, self.y)
    for end in ends:  # Waits for every device's last action.
      end.numpy()
    return time.perf_counter() - start, sends

  def _actions(self, c, actions, inputs, grads, y):
    """Chunk c's `actions` on one micro-batch, on every device at once and
    in order on each, as the executor builds them (with no action, only
    the copies of what they would receive). Call traced.

    Returns:
      A one-element slice of each device's last result, after all its
      actions; and what device 0's actions send, by kind of what is sent
      ("F": activations, "G": the previous chunk's gradients).
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    ends, sends = [], None

    def copy(tensors):
      return tensors and [None if t is None else tf.identity(t)
                          for t in tensors]

    for device in self.devices:
      with tf.device(device):
        received, grads_out = copy(inputs), copy(grads)
        labels = tf.identity(y)
        done = [t for t in received + (grads_out or []) if t is not None]
        done.append(labels)
        sent, records, kept, accum, shares = {}, {}, {}, [None] * len(
            self.executor.chunks), []
        for kind in actions:
          with tf.control_dependencies(done):
            done = self.executor.build_action(
                Action(kind, 0, c),
                {FORWARD: received, WEIGHT_GRAD: []}.get(kind, grads_out),
                labels, None, sent, records, kept, accum, shares) or done
        with tf.control_dependencies(done):
          ends.append(tf.reshape(done[-1], [-1])[:1])
      if sends is None:
        sends = {kind: value for (kind, _, _), value in sent.items()}
    return ends, sends


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
                   jit_compile: bool = False, host_timed: bool = False
                   ) -> Tuple[List[ChunkSeconds], Optional[List[ChunkSeconds]]]:
  """F, I, W and B seconds of each chunk: (alone, crowded).

  Alone runs on `devices[0]` with the other devices idle; crowded runs the
  same actions on every device of `devices` at once (None for one device).
  `repeats` timed runs follow one that traces; the arguments are
  `ChunkTimer`'s, and `host_timed` times them with a `HostTimer` (under
  op determinism).
  """
  def timed(on):
    timer = (HostTimer if host_timed else ChunkTimer)(
        chunks, x, y, task, on, recompute, backward, jit_compile)
    timer.durations()  # Traces: not timed.
    return chunk_seconds(timer.row, np.stack(
        [timer.durations() for _ in range(repeats)]))

  return timed(devices[:1]), timed(devices) if len(devices) > 1 else None


def chunk_measurer(layers, dataset, microbatch: int, task,
                   devices: Sequence[str], recompute: str, cores: float,
                   jit_compile: bool = False, host_timed: bool = False
                   ) -> Callable[[Sequence[int]], tuple]:
  """bounds -> `measure_chunks` of layers [bounds[c], bounds[c+1]), with
  each distinct cut measured once: crowded on as many of `devices` at once
  as run without sharing a core (`cores`: `costs.shared_cores`); compiled
  with `jit_compile`, and then alone only (see the module docstring);
  timed from the host with `host_timed`."""
  devices = devices[:1 if jit_compile else int(min(cores, len(devices)))]
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x = tf.constant(dataset.train_x[:microbatch])
  y = tf.constant(dataset.train_y[:microbatch])
  cache: Dict[Tuple[int, ...], tuple] = {}

  def measure(bounds):
    key = tuple(bounds)
    if key not in cache:
      cache[key] = measure_chunks(
          [layers[a:b] for a, b in zip(key, key[1:])], x, y, task, devices,
          recompute, jit_compile=jit_compile, host_timed=host_timed)
    return cache[key]
  return measure
