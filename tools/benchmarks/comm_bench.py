r"""Communication-efficient data parallelism: bytes on the wire, accuracy, time.

    python -m tools.bench --suite=comm [--quick]
    python -m tools.benchmarks.comm_bench [--quick]

The seed CNN on digits (Adam 1e-3, global batch 64, seed 0), on 2 and 4
replicas (logical CPU devices): float32 sync, bf16, PowerSGD at ranks 1 and
4, top-k 1%, local SGD H=8 (average) and DiLoCo H=8 and H=32 (Nesterov 0.7,
0.9). Every variant lives in one process and trains interleaved, `CHUNK`
steps per round (the machine is shared and noisy: interleaving gives every
variant the same noise), and is evaluated after each chunk. Per variant:

* bytes per step that each replica hands to the collectives (the trainer's
  summary: `allreduce_bytes_per_step`), and how many times fewer than
  float32 sync;
* eval accuracy after `STEPS` steps (equal steps), in points against float32
  sync at the same replica count;
* steps to the target (95%): the first evaluation at or above it; seconds to
  it: those steps times the median step time;
* examples/sec: the median over chunks (the first, tracing chunk excluded),
  with the min-max spread.

Then the issue's targets, met or not, per replica count. `--quick`: the MLP,
2 replicas, three variants, a lower target: a smoke run of the harness.
Logical CPU devices share the cores, so examples/sec shows the cost of the
compression's compute, not the saving on a real network.
"""

import os
import statistics
import sys
from typing import Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # pylint: disable=g-import-not-at-top

from dist_loop.runtime import devices  # pylint: disable=g-import-not-at-top
from tools.benchmarks import common  # pylint: disable=g-import-not-at-top

CHUNK = 32  # A multiple of every H: local SGD is evaluated right after a sync.
DILOCO = dict(mode="local_sgd", outer_optimizer="nesterov",
              outer_learning_rate=0.7, outer_momentum=0.9)
VARIANTS = {
    "float32": dict(),
    "bf16": dict(allreduce_compression="bf16"),
    "powersgd r=1": dict(allreduce_compression="powersgd", powersgd_rank=1),
    "powersgd r=4": dict(allreduce_compression="powersgd", powersgd_rank=4),
    "topk 1%": dict(allreduce_compression="topk", topk_fraction=0.01),
    "local_sgd H=8": dict(mode="local_sgd", sync_every=8),
    "DiLoCo H=8": dict(DILOCO, sync_every=8),
    "DiLoCo H=32": dict(DILOCO, sync_every=32),
}
SETTINGS = {  # quick: a smoke run of the harness; full: the numbers in docs/benchmarks.md.
    True: dict(model="mlp", replicas=(2,), steps=2 * CHUNK, target=0.5,
               variants=("float32", "powersgd r=1", "DiLoCo H=32")),
    False: dict(model="cnn", replicas=(2, 4), steps=20 * CHUNK, target=0.95,
                variants=tuple(VARIANTS)),
}
# (variant, at least this many times fewer bytes than float32, within
# this many points of its accuracy at equal steps).
TARGETS = (("powersgd r=4", 10, 1.0), ("DiLoCo H=32", 32, 1.0))


class _Variant(common.ChunkedRun):
  """One (variant, replicas): its trainer, evaluator and measurements."""

  def __init__(self, name: str, replicas: int, settings, split, names):
    self.name, self.replicas = name, replicas
    flat = dict(dataset="digits", model=settings["model"],
                num_devices=replicas, global_batch_size=64, optimizer="adam",
                learning_rate=1e-3, seed=0, train_steps=settings["steps"],
                **VARIANTS[name])
    keras.utils.set_random_seed(0)  # The same initial weights everywhere.
    config, trainer = common.trainer(names[:replicas], flat, split)
    super().__init__(trainer, split, config.eval_batch_size, CHUNK)
    self.examples_per_chunk = CHUNK * config.global_batch_size

  def row(self, target: float) -> Dict[str, object]:
    summary = self.trainer.summary()
    rates = [self.examples_per_chunk / s for s in self.chunk_seconds]
    step_s = statistics.median(self.chunk_seconds) / CHUNK
    return {
        "replicas": self.replicas, "variant": self.name, "target": target,
        "bytes_per_step": summary["allreduce_bytes_per_step"],
        "ratio_to_float32": summary["allreduce_ratio_to_float32"],
        "steps": self.steps, "eval_accuracy": self.accuracy,
        "steps_to_target": self.steps_to_target,
        "seconds_to_target": (None if self.steps_to_target is None
                              else self.steps_to_target * step_s),
        "examples_per_sec": statistics.median(rates),
        "examples_per_sec_min": min(rates),
        "examples_per_sec_max": max(rates),
    }


def with_baseline(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
  """Adds each row's `x_fewer_bytes` and `points_vs_float32`, against the
  float32 row of the same replica count."""
  base = {r["replicas"]: r for r in rows if r["variant"] == "float32"}
  for r in rows:
    b = base[r["replicas"]]
    r["x_fewer_bytes"] = b["bytes_per_step"] / r["bytes_per_step"]
    r["points_vs_float32"] = 100 * (r["eval_accuracy"] - b["eval_accuracy"])
  return rows


def verdicts(rows: List[Dict[str, object]]) -> List[str]:
  """One line per target and replica count: met or not, and why."""
  lines = []
  for name, fewer, points in TARGETS:
    for r in rows:
      if r["variant"] != name:
        continue
      ok = r["x_fewer_bytes"] >= fewer and r["points_vs_float32"] >= -points
      lines.append(
          f"- {name}, {r['replicas']} replicas: {r['x_fewer_bytes']:.1f}x "
          f"fewer bytes (target >= {fewer}x), "
          f"{r['points_vs_float32']:+.1f} points vs float32 (target >= "
          f"-{points:g}): {'met' if ok else 'NOT met'}")
  return lines


def table(rows: List[Dict[str, object]]) -> str:
  target = f"{rows[0]['target']:.0%}"
  lines = [f"| replicas | variant | bytes/step | x fewer | eval acc at "
           f"{rows[0]['steps']} | vs float32 | steps to {target} | "
           f"s to {target} | examples/s (min-max) |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    secs = r["seconds_to_target"]
    lines.append(
        f"| {r['replicas']} | {r['variant']} | {r['bytes_per_step']:,.0f} "
        f"| {r['x_fewer_bytes']:.1f} | {r['eval_accuracy']:.3f} "
        f"| {r['points_vs_float32']:+.1f} "
        f"| {r['steps_to_target'] or 'not reached'} "
        f"| {'-' if secs is None else f'{secs:.1f}'} "
        f"| {r['examples_per_sec']:,.0f} ({r['examples_per_sec_min']:,.0f}-"
        f"{r['examples_per_sec_max']:,.0f}) |")
  return "\n".join(lines)


def run(quick: bool = False) -> dict:
  """Trains every (replicas, variant) interleaved; its rows, and the table
  followed by the verdicts on the targets."""
  settings = SETTINGS[quick]
  names = devices.configure(max(settings["replicas"]), "cpu")
  split = common.load_data(
      common.config(dataset="digits", model=settings["model"]))
  runs = [_Variant(v, n, settings, split, names)
          for n in settings["replicas"] for v in settings["variants"]]
  try:
    for _ in range(settings["steps"] // CHUNK):
      for v in runs:
        v.train_chunk(settings["target"])
    rows = with_baseline([v.row(settings["target"]) for v in runs])
  finally:
    for v in runs:
      v.trainer.close()
  return {"rows": rows,
          "table": table(rows) + "\n\n" + "\n".join(verdicts(rows))}


if __name__ == "__main__":
  print(run(quick="--quick" in sys.argv)["table"])
