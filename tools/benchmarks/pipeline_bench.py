r"""Pipeline benchmark: throughput, bubble and memory against micro-batches.

    python -m tools.benchmarks.pipeline_bench [--quick] [--timeline=PATH]

Two stages of the `deep_mlp` model (split by parameters: 4 + 4 of its wide
layers) on two logical CPU devices, one intra-op thread per op and two
inter-op threads, so each stage gets about one core. For M = 1, 2, 4, 8, 16
and both schedules it measures seconds per step, the speed-up over the
naive split (M=1: one stage works while the other waits), the formula's
ideal speed-up M*K/(M+K-1), the measured bubble against (K-1)/(M+K-1), and
the peak memory of a step. A row of single-device sync (the whole model on
one core) is the no-parallelism reference.

Thread pools are fixed when TensorFlow starts, so the suite runs in one
fresh subprocess that sets them first. The machine may be shared, so, as in
`tools/benchmarks/common.py`, the variants are timed interleaved, round by
round, and each reports its median; the bubble is its median too. Memory is
the peak of TensorFlow's CPU allocator during a variant's steps above what
was allocated before them (BFC allocator, so every tensor is tracked; the
logical devices share it). This is a benchmark, not a test.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

NUM_STAGES = 2
GLOBAL_BATCH = 1024
MICROBATCHES = (1, 2, 4, 8, 16)
QUICK_MICROBATCHES = (1, 4)
SCHEDULES = ("gpipe", "1f1b")
TIMELINE_M = 8


def _variants(quick: bool) -> List[Dict]:
  out = [{"name": "sync, 1 device", "mode": "sync", "m": 1}]
  out += [{"name": f"pipeline {s}", "mode": "pipeline", "schedule": s, "m": m}
          for s in SCHEDULES
          for m in (QUICK_MICROBATCHES if quick else MICROBATCHES)]
  return out


# -- the measurements, in a fresh process --

def _worker(spec: Dict) -> List[Dict]:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  from dist_loop import devices  # pylint: disable=g-import-not-at-top
  names = devices.configure(NUM_STAGES, "cpu", intra_op_threads=1,
                            inter_op_threads=NUM_STAGES)
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from dist_loop import data  # pylint: disable=g-import-not-at-top
  from tools.benchmarks import common  # pylint: disable=g-import-not-at-top
  flat = dict(dataset="synthetic", model="deep_mlp",
              global_batch_size=GLOBAL_BATCH, optimizer="sgd",
              learning_rate=0.01, intra_op_threads=1,
              inter_op_threads=NUM_STAGES)
  split = data.load(common.config(**flat))
  trainers = []
  for v in _variants(spec["quick"]):
    mode = dict(mode="sync", num_devices=1)
    if v["mode"] == "pipeline":
      mode = dict(mode="pipeline", num_devices=NUM_STAGES,
                  num_stages=NUM_STAGES, stage_split="params",
                  num_microbatches=v["m"], pipeline_schedule=v["schedule"])
    keras.utils.set_random_seed(0)
    _, trainer = common.trainer(names[:mode["num_devices"]],
                                {**flat, **mode}, split)
    trainer.train(spec["warmup"])  # Traces, and warms up the allocator.
    trainers.append(trainer)
  seconds = [[] for _ in trainers]
  bubbles = [[] for _ in trainers]
  peaks = [0.0 for _ in trainers]
  metrics = [{} for _ in trainers]
  for _ in range(spec["rounds"]):
    for i, trainer in enumerate(trainers):
      tf.config.experimental.reset_memory_stats("CPU:0")
      base = tf.config.experimental.get_memory_info("CPU:0")["current"]
      t0 = time.perf_counter()
      metrics[i] = trainer.train(spec["steps"])
      seconds[i].append((time.perf_counter() - t0) / spec["steps"])
      peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
      peaks[i] = max(peaks[i], peak / 2**20)
      bubbles[i].append(metrics[i].get("pipeline/bubble_measured"))
  rows = []
  for i, (v, trainer) in enumerate(zip(_variants(spec["quick"]), trainers)):
    row = {"config": v["name"], "m": v["m"] if v["mode"] == "pipeline"
           else "-", "seconds_per_step": statistics.median(seconds[i]),
           "peak_mb": peaks[i],
           "bubble_measured": (statistics.median(bubbles[i])
                               if bubbles[i][0] is not None else None),
           "bubble_formula": metrics[i].get("pipeline/bubble_formula")}
    if v["mode"] == "pipeline":
      starts, ends = trainer._last_timeline  # pylint: disable=protected-access
      row["starts"], row["ends"] = starts.tolist(), ends.tolist()
    rows.append(row)
    trainer.close()
  return rows


def _run_worker(spec: Dict) -> List[Dict]:
  result = subprocess.run(
      [sys.executable, "-m", "tools.benchmarks.pipeline_bench", "--worker",
       json.dumps(spec)], capture_output=True, text=True, check=False,
      # The BFC allocator on CPU, so that get_memory_info tracks every
      # tensor (the default CPU allocator reports coarse numbers).
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_CPU_ALLOCATOR_USE_BFC": "true"})
  if result.returncode:
    raise RuntimeError(f"pipeline benchmark worker failed:\n{result.stderr}")
  return json.loads(result.stdout.strip().splitlines()[-1])


# -- the suite --

def run(quick: bool = False, timeline_path: str = None) -> Dict:
  """Runs every variant; returns {"rows": [...], "table": markdown}.

  Args:
    quick: M in {1, 4} only, one step, one round (a smoke run of the
      harness, not numbers to quote).
    timeline_path: if set, a PNG of the measured GPipe and 1F1B timelines
      at M=8 is written there, above their simulated ideal (equal stages,
      backward twice the forward).
  """
  timing = ({"steps": 1, "rounds": 1, "warmup": 1} if quick
            else {"steps": 4, "rounds": 7, "warmup": 2})
  rows = _run_worker({"quick": quick, **timing})
  naive = {r["config"]: r["seconds_per_step"] for r in rows if r["m"] == 1}
  for r in rows:
    if r["m"] != "-":
      r["speedup"] = naive[r["config"]] / r["seconds_per_step"]
      r["ideal_speedup"] = r["m"] * NUM_STAGES / (r["m"] + NUM_STAGES - 1)
  if timeline_path:
    _draw(rows, timeline_path)
  for r in rows:
    r.pop("starts", None)
    r.pop("ends", None)
  return {"rows": rows, "table": table(rows), "global_batch": GLOBAL_BATCH,
          **timing}


def table(rows: List[Dict]) -> str:
  """The rows as a markdown table."""
  lines = ["| config | M | s/step | examples/s | speed-up vs M=1 | ideal "
           "M·K/(M+K−1) | bubble measured | bubble formula | peak MB |",
           "|---|---|---|---|---|---|---|---|---|"]

  def fmt(value, spec):
    return "–" if value is None else format(value, spec)

  for r in rows:
    lines.append(
        f"| {r['config']} | {r['m']} | {r['seconds_per_step']:.3f} | "
        f"{GLOBAL_BATCH / r['seconds_per_step']:.0f} | "
        f"{fmt(r.get('speedup'), '.2f')} | {fmt(r.get('ideal_speedup'), '.2f')}"
        f" | {fmt(r.get('bubble_measured'), '.2f')} | "
        f"{fmt(r.get('bubble_formula'), '.2f')} | {r['peak_mb']:.1f} |")
  return "\n".join(lines)


def schedule_name(row) -> str:
  return row["config"].split()[-1]


def _draw(rows, path):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from dist_loop.modes.pipeline import schedule as sl  # pylint: disable=g-import-not-at-top
  from dist_loop.modes.pipeline import timeline  # pylint: disable=g-import-not-at-top
  images = []
  for r in rows:
    if r["m"] == TIMELINE_M and "starts" in r:
      schedule = sl.make(schedule_name(r), NUM_STAGES, TIMELINE_M)
      bars = timeline.bars_from_timestamps(schedule, np.array(r["starts"]),
                                           np.array(r["ends"]))
      span_ms = 1e3 * max(end for _, _, _, end in bars)
      images.append(timeline.render(
          bars, NUM_STAGES, title=f"{schedule_name(r)} K={NUM_STAGES} "
          f"M={TIMELINE_M} {span_ms:.0f} MS"))
  for name in SCHEDULES:  # The same schedules, simulated: the ideal.
    bars = timeline.bars_from_simulation(
        sl.make(name, NUM_STAGES, TIMELINE_M))
    images.append(timeline.render(
        bars, NUM_STAGES,
        title=f"{name} K={NUM_STAGES} M={TIMELINE_M} IDEAL B=2F"))
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  timeline.write_png(path, timeline.stack(images))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--timeline", default=None,
                      help="write the measured M=8 timelines to this PNG")
  parser.add_argument("--out", default=None, help="write the rows as JSON")
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    print(json.dumps(_worker(json.loads(args.worker))))
    return
  result = run(args.quick, args.timeline)
  print(result["table"])
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
