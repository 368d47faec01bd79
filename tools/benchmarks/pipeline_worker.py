"""A worker process of the pipeline benchmark, and its driver.

    python -m tools.benchmarks.pipeline_worker SPEC_JSON

A worker runs one thread setting (`devices.configure` can run once per
process): it builds its variants' trainers once (each measures its costs at
start), then measures one round of every variant per `round` line on its
stdin and answers with one JSON line; any other line ends it with the
pipelines' predictions and last measured timelines. `Worker` is the
parent's end of those pipes (`pipeline_bench.run` drives several in turn,
so each measures while the others are idle).

A worker's terminal is quiet (`dist_loop/runtime/console.py` at verbosity -1:
our warnings and errors, no one else's below an error): the benchmark's lines
are the parent's table.
"""

import json
import os
import subprocess
import sys
import time
from typing import Dict

WIDE_MLP = "bench_wide_mlp"


def wide_mlp(input_shape, num_classes):
  """A projection to 1024, then eight Dense(1024): four times deep_mlp's work
  per layer, and as many heavy layers as 2, 4 or 8 chunks can share
  evenly."""
  import keras  # pylint: disable=g-import-not-at-top
  del input_shape
  return ([keras.layers.Flatten(name="flatten"),
           keras.layers.Dense(1024, activation="relu", name="dense_in")]
          + [keras.layers.Dense(1024, activation="relu", name=f"dense_{i}")
             for i in range(8)]
          + [keras.layers.Dense(num_classes, name="logits")])


def _trainer(names, spec, variant):
  import keras  # pylint: disable=g-import-not-at-top
  from tools.benchmarks import common  # pylint: disable=g-import-not-at-top
  flat = dict(dataset="synthetic", model=variant["model"],
              global_batch_size=variant["batch"], optimizer="sgd",
              learning_rate=0.01, intra_op_threads=spec["intra"],
              inter_op_threads=spec["inter"], train_steps=10**9,
              log_every=spec["steps"] + 1, mode="sync", num_devices=1)
  if variant.get("accum"):  # The batch as micro-batches, one at a time.
    flat.update(global_batch_size=variant["batch"] // variant["accum"],
                grad_accum_steps=variant["accum"])
  if variant["k"]:
    flat.update(mode="pipeline", num_devices=variant["k"],
                num_stages=variant["k"], stage_split="params",
                num_microbatches=variant["m"],
                pipeline_schedule=variant["schedule"])
  keras.utils.set_random_seed(0)
  return common.trainer(names[:flat["num_devices"]], flat)[1]


def serve(spec: Dict) -> None:
  """Builds `spec`'s variants, then answers rounds on stdin (above)."""
  from dist_loop.runtime import console  # pylint: disable=g-import-not-at-top
  from experiments import startup  # pylint: disable=g-import-not-at-top
  with startup.matplotlib_deferred():
    console.start(-1)  # Imports TensorFlow, quietly.
  console.setup(-1)
  from dist_loop.models import MODELS  # pylint: disable=g-import-not-at-top
  from dist_loop.parallel.modes.pipeline import timeline  # pylint: disable=g-import-not-at-top
  from dist_loop.runtime import devices  # pylint: disable=g-import-not-at-top
  MODELS.register(WIDE_MLP)(wide_mlp)
  names = devices.configure(spec["devices"], "cpu", spec["intra"],
                            spec["inter"])
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  trainers = [_trainer(names, spec, v) for v in spec["variants"]]
  for t in trainers:
    t.train(spec["steps"] + 1)  # Traces both loops; warms the allocator.
  say = lambda obj: print(json.dumps(obj), flush=True)  # pylint: disable=unnecessary-lambda-assignment
  say("ready")
  for line in sys.stdin:
    if line.strip() != "round":
      break
    rows = []
    for t in trainers:
      tf.config.experimental.reset_memory_stats("CPU:0")
      base = tf.config.experimental.get_memory_info("CPU:0")["current"]
      t0 = time.perf_counter()
      t.train(spec["steps"])
      seconds = time.perf_counter() - t0
      peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
      row = {"s": seconds / spec["steps"], "mb": peak / 2**20,
             "bubble": None}
      if hasattr(t, "plan"):
        t.train(1)  # Lands on a log step: the one timed step.
        scalars = t.report().scalars
        row.update(bubble=scalars["pipeline/bubble_measured"],
                   span=scalars["pipeline/step_ms"] / 1e3,
                   durations=timeline.median_durations(t.timeline_bars()))
      rows.append(row)
    say(rows)
  say([_final(t) for t in trainers])


def _final(trainer):
  """A pipeline's prediction and last measured timeline (False for sync)."""
  if not hasattr(trainer, "plan"):
    return False
  chosen = trainer.plan.chosen
  return {"name": chosen.name, "v": chosen.schedule.virtual_stages,
          "step_s": chosen.prediction.step_time,
          "bubble": chosen.prediction.bubble,
          "peak_mb": chosen.prediction.peak_mb,
          "crowded": chosen.costs.crowded,
          "bars": [(d, str(a), a.kind, s, e)
                   for d, a, s, e in trainer.timeline_bars()]}


class Worker:
  """A worker process, driven one round at a time over its pipes."""

  def __init__(self, spec):
    self.spec = spec
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "tools.benchmarks.pipeline_worker",
         json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                        "TF_CPU_ALLOCATOR_USE_BFC": "true"})

  def send(self, command) -> None:
    self.proc.stdin.write(command + "\n")
    self.proc.stdin.flush()

  def ask(self, command):  # The worker's next line, after `command`.
    if command:
      self.send(command)
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"pipeline benchmark worker {self.spec['devices']} "
                         f"device(s) died (exit {self.proc.wait()})")
    return json.loads(line)

  def close(self, timeout: float = 60.0) -> None:
    """Waits for the worker to exit after its last answer; kills it if it
    does not within `timeout` seconds."""
    try:
      self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait(timeout=timeout)


if __name__ == "__main__":
  serve(json.loads(sys.argv[1]))
