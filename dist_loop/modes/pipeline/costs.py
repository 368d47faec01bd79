"""What each layer costs, measured at start, and a chunk's costs from them.

`measure_traced` times each layer as the executor runs it: every layer is a
chunk of a one-device schedule (F of each layer, then I and W of each in
reverse) on one micro-batch of real data, traced and run a few times with
per-action timestamps; the median of each action is kept. Those are the
ops, the op overhead and the thread pools of the run itself. Under op
determinism timestamps are refused, and `measure_layers` times each layer
eagerly instead (rough: eager dispatch adds time per op that a traced step
does not pay, a lot for small micro-batches). A B is costed as its I + W.

Sizes are counted at layer boundaries: a layer's backward needs its input
and (for its activation's derivative) its output, so a chunk keeps
sum(input + output bytes) of its layers per micro-batch from F to the
backward, and the same from I to W (the joins' inputs, and gradients the
size of the outputs). Layers with large internal activations (attention)
keep more than this estimate.
"""

import dataclasses
import statistics
import time
from typing import List, Sequence

import numpy as np

from dist_loop.modes.pipeline.schedule import I, F, W, Schedule
from dist_loop.modes.pipeline.simulator import ChunkCosts


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """One layer on one micro-batch: seconds and bytes."""

  forward: float
  input_grad: float
  weight_grad: float
  backward: float
  input_bytes: int
  output_bytes: int


def _median_seconds(fn, repeats: int) -> float:
  if not repeats:
    return 0.0
  fn()  # Warm-up.
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(statistics.median(times))


def _nbytes(t) -> int:
  return int(np.prod(t.shape)) * t.dtype.size


def measure_layers(layers, input_shape, batch_size: int,
                   input_dtype: str = "float32",
                   repeats: int = 3) -> List[LayerCost]:
  """F, I, W and B seconds (eager) and boundary sizes of each layer.

  Each layer runs on random input of the shape its predecessor gives: its
  forward, and from one persistent tape its input gradient, its weight
  gradients, and both at once.

  Args:
    layers: the model's built layers.
    input_shape: one example's shape.
    batch_size: examples per micro-batch.
    input_dtype: the model's input dtype (token ids are zeros).
    repeats: timed runs per measurement (after one warm-up); 0: sizes
      only, no time.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  shape = (batch_size,) + tuple(input_shape)
  x = (tf.random.normal(shape) if input_dtype == "float32"
       else tf.zeros(shape, input_dtype))
  out = []
  for layer in layers:
    variables = list(layer.trainable_variables)
    differentiable = x.dtype.is_floating
    with tf.GradientTape(persistent=True) as tape:
      if differentiable:
        tape.watch(x)
      y = layer(x, training=True)
    dy = tf.ones_like(y)
    inputs = [x] if differentiable else []

    def grad(sources, tape=tape, y=y, dy=dy):
      return tape.gradient(y, sources, output_gradients=dy) if sources else []

    out.append(LayerCost(
        forward=_median_seconds(lambda l=layer, x=x: l(x, training=True),
                                repeats),
        input_grad=_median_seconds(lambda: grad(inputs), repeats),
        weight_grad=_median_seconds(lambda: grad(variables), repeats),
        backward=_median_seconds(lambda: grad(inputs + variables), repeats),
        input_bytes=_nbytes(x), output_bytes=_nbytes(y)))
    del tape
    x = y
  return out


def measure(layers, dataset, microbatch: int, input_dtype: str, task,
            device: str, traced: bool = True) -> List[LayerCost]:
  """Each layer's costs on one micro-batch of `dataset`'s training data:
  `measure_traced`, or `measure_layers` (eager) if not `traced`."""
  sizes = measure_layers(layers, dataset.input_shape, microbatch, input_dtype,
                         repeats=0 if traced else 3)
  if not traced:
    return sizes
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return measure_traced(layers, sizes,
                        tf.constant(dataset.train_x[:microbatch]),
                        tf.constant(dataset.train_y[:microbatch]), task,
                        device)


def measure_traced(layers, layer_costs: Sequence[LayerCost], x, y, task,
                   device: str, repeats: int = 5) -> List[LayerCost]:
  """`layer_costs` with the seconds of a traced run of each layer.

  Args:
    layers: the model's built layers.
    layer_costs: their sizes (`measure_layers`).
    x, y: one micro-batch of the training data.
    task: the run's task (the last layer's loss).
    device: where to run.
    repeats: timed runs (after one that traces).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from dist_loop.modes.pipeline.executor import PipelineExecutor  # pylint: disable=g-import-not-at-top
  n = len(layers)
  row = [F(0, c) for c in range(n)] + [
      a for c in reversed(range(n)) for a in (I(0, c), W(0, c))]
  executor = PipelineExecutor([[layer] for layer in layers],
                              Schedule.of([row], [0] * n), [[device]], 1,
                              task, len(x))
  step = tf.function(lambda x, y: executor.step(x, y, timed=True))
  runs = []
  for _ in range(repeats + 1):
    out = step(x, y)
    runs.append((out["ends"] - out["starts"]).numpy()[0, 0])
  seconds = np.median(runs[1:], axis=0)
  forward = seconds[:n]
  input_grad = [seconds[n + 2 * (n - 1 - c)] for c in range(n)]
  weight_grad = [seconds[n + 2 * (n - 1 - c) + 1] for c in range(n)]
  return [dataclasses.replace(
      cost, forward=float(forward[c]), input_grad=float(input_grad[c]),
      weight_grad=float(weight_grad[c]),
      backward=float(input_grad[c] + weight_grad[c]))
          for c, cost in enumerate(layer_costs)]


def for_chunks(layer_costs: Sequence[LayerCost], bounds: Sequence[int],
               recompute: str = "never", overhead: float = 0.0,
               transfer: float = 0.0) -> ChunkCosts:
  """The simulator's costs of chunks [bounds[c], bounds[c+1]) of layers.

  With recompute (`options.RECOMPUTE`), I and B also pay the chunk's
  forward again.
  """
  chunks = [layer_costs[a:b] for a, b in zip(bounds, bounds[1:])]
  last = len(chunks) - 1

  def total(name, part):
    return float(sum(getattr(l, name) for l in part))

  recomputes = tuple(recompute == "always" or (
      recompute == "except_last" and c < last) for c in range(len(chunks)))

  def again(c):  # The forward that a recomputing backward runs first.
    return total("forward", chunks[c]) if recomputes[c] else 0.0

  kept = tuple(total("input_bytes", p) + total("output_bytes", p)
               for p in chunks)
  return ChunkCosts(
      forward=tuple(total("forward", p) for p in chunks),
      input_grad=tuple(total("input_grad", p) + again(c)
                       for c, p in enumerate(chunks)),
      weight_grad=tuple(total("weight_grad", p) for p in chunks),
      backward=tuple(total("backward", p) + again(c)
                     for c, p in enumerate(chunks)),
      activation_bytes=kept, weight_grad_bytes=kept,
      input_bytes=tuple(float(p[0].input_bytes) for p in chunks),
      recomputes=recomputes, overhead=overhead, transfer=transfer)
