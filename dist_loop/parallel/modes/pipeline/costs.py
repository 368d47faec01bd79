"""What each layer and chunk costs, measured at start, and the simulator's
costs of a plan's chunks from them.

`measure_traced` times each layer as a chunk of its own, as the executor
runs it (`timing.py`, compiled with `--jit_compile`), on the first
micro-batch only (B = I + W), to partition the model; the planner then
times each candidate's own chunks (a chunk of n layers pays one action's
overhead, not n), alone and crowded. Under op determinism, which refuses
timestamps, both are timed from the host (`timing.HostTimer`): the same
chunks, compiled the same way, only less precisely. `measure_layers` times
each layer eagerly (rough: eager dispatch adds time per op that a traced
step does not pay, a lot for small micro-batches; and never compiled): a
quicker start for tests, which plan without tracing.

Sizes are counted at layer boundaries: a layer's backward needs its input
and (for its activation's derivative) its output, so a chunk keeps
sum(input + output bytes) of its layers per micro-batch from F to the
backward, and the same from I to W (the joins' inputs, and gradients the
size of the outputs). Layers with large internal activations (attention)
keep more than this estimate.

`shared_cores` says how many actions run at once without sharing a core
(logical CPU devices share the process's cores), for the simulator.
"""

import dataclasses
import math
import os
import statistics
import time
from typing import List, Optional, Sequence

import numpy as np

from dist_loop.parallel.modes.pipeline import timing
from dist_loop.parallel.modes.pipeline.simulator import ChunkCosts


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
            device: str, traced: bool = True, jit_compile: bool = False,
            host_timed: bool = False) -> List[LayerCost]:
  """Each layer's costs on one micro-batch of `dataset`'s training data:
  `measure_traced` (compiled with `jit_compile`, timed from the host with
  `host_timed`), or `measure_layers` (eager, never compiled) if not
  `traced`."""
  sizes = measure_layers(layers, dataset.input_shape, microbatch, input_dtype,
                         repeats=0 if traced else 3)
  if not traced:
    return sizes
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return measure_traced(layers, sizes,
                        tf.constant(dataset.train_x[:microbatch]),
                        tf.constant(dataset.train_y[:microbatch]), task,
                        device, jit_compile=jit_compile,
                        host_timed=host_timed)


def measure_traced(layers, layer_costs: Sequence[LayerCost], x, y, task,
                   device: str, repeats: int = 5,
                   jit_compile: bool = False,
                   host_timed: bool = False) -> List[LayerCost]:
  """`layer_costs` with the seconds of a traced run of each layer (each
  layer a chunk of `timing.measure_chunks`; B taken as I + W, or timed
  itself when compiled: these only balance the chunks, which are then
  timed themselves).

  Args:
    layers: the model's built layers.
    layer_costs: their sizes (`measure_layers`).
    x, y: one micro-batch of the training data.
    task: the run's task (the last layer's loss).
    device: where to run.
    repeats: timed runs (after one that traces).
    jit_compile: each layer compiled as the run's chunks are.
    host_timed: timed from the host (`timing.HostTimer`), without
      timestamps: under op determinism.
  """
  measured, _ = timing.measure_chunks(
      [[layer] for layer in layers], x, y, task, [device], repeats=repeats,
      backward=False, jit_compile=jit_compile, host_timed=host_timed)
  return [dataclasses.replace(cost, forward=f, input_grad=i, weight_grad=w,
                              backward=b)
          for cost, (f, i, w, b) in zip(layer_costs, measured)]


def shared_cores(devices: Sequence[str], intra_op_threads: int,
                 inter_op_threads: int = 0, replicas: int = 1) -> float:
  """How many actions of one pipeline run at once without sharing a core.

  Logical CPU devices run on the process's cores, split among the R
  data-parallel replicas; at most `inter_op_threads` ops run at once, each
  on up to `intra_op_threads` cores (0: TensorFlow's default, all). Other
  devices (GPUs) have their own: infinite.
  """
  if not all("CPU" in d.upper() for d in devices):
    return math.inf
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count() or 1)
  per_action = min(intra_op_threads or cores, cores)
  usable = min(cores, (inter_op_threads or cores) * per_action)
  return max(usable / max(replicas, 1) / per_action, 1.0)


def for_chunks(layer_costs: Sequence[LayerCost], bounds: Sequence[int],
               recompute: str = "never", measured: Optional[tuple] = None,
               cores: float = math.inf) -> ChunkCosts:
  """The simulator's costs of chunks [bounds[c], bounds[c+1]) of layers.

  Args:
    layer_costs: every layer's costs (sizes, and seconds if measured).
    bounds: the chunks' first layers, and the end.
    recompute: one of `options.RECOMPUTE`; without `measured`, I and B
      then pay the chunk's forward again.
    measured: the chunks' own (alone, crowded) seconds
      (`timing.measure_chunks`, with the same recompute); None: the sums
      of their layers', alone.
    cores: `shared_cores`.
  """
  chunks = [layer_costs[a:b] for a, b in zip(bounds, bounds[1:])]
  last = len(chunks) - 1

  def total(name, part):
    return float(sum(getattr(l, name) for l in part))

  recomputes = tuple(recompute == "always" or (
      recompute == "except_last" and c < last) for c in range(len(chunks)))

  def again(c):  # The forward that a recomputing backward runs first.
    return total("forward", chunks[c]) if recomputes[c] else 0.0

  alone, crowded = measured or ([
      (total("forward", p), total("input_grad", p) + again(c),
       total("weight_grad", p), total("backward", p) + again(c))
      for c, p in enumerate(chunks)], None)
  forward, input_grad, weight_grad, backward = (
      tuple(m[j] for m in alone) for j in range(4))
  kept = tuple(total("input_bytes", p) + total("output_bytes", p)
               for p in chunks)
  return ChunkCosts(
      forward=forward, input_grad=input_grad, weight_grad=weight_grad,
      backward=backward, activation_bytes=kept, weight_grad_bytes=kept,
      input_bytes=tuple(float(p[0].input_bytes) for p in chunks),
      recomputes=recomputes, cores=cores,
      crowded=tuple(tuple(row) for row in crowded) if crowded else ())
