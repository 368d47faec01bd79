r"""Sharded sync (`--shard`): memory per device against ZeRO, and the cost.

    python -m tools.bench --suite=memory [--quick]
    python -m tools.benchmarks.memory_bench [--quick]

A Transformer large enough that its training state dominates the process
(8 blocks of 384: about 14M parameters, 230 MB of float32 Adam state per
replica), on 1, 2 and 4 logical devices of this machine's cores, at every
stage. Each (replicas, stage) trains in a process of its own, since a peak
resident set is per process (`scale_worker.py`); the four stages of one
replica count are alive together and timed in interleaved rounds.

Per row: what a device holds (weights, gradients, optimizer slots, from
the trainer's accounting), ZeRO's formula, the padding and the buffers that
live only during a step; the process's peak RSS above a fresh process's
(all the replicas of a process together, plus activations); and
examples/s (median, min-max over the rounds) against the unsharded run
with the same replicas. Logical devices share the cores: the throughput is
the cost of the extra collectives and copies, not of a slow network.
"""

import os
import socket
import statistics
import sys
import tempfile
from typing import Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.benchmarks import common  # pylint: disable=g-import-not-at-top
from tools.benchmarks.scale_bench import Group  # pylint: disable=g-import-not-at-top

STAGES = ("none", "optimizer", "gradients", "weights")
MODEL = dict(dataset="pysource", model="transformer", seq_len=64,
             num_layers=8, d_model=384, num_heads=6, optimizer="adam",
             learning_rate=1e-3, seed=0)
SETTINGS = {  # quick: a smoke run of the harness; full: the docs' numbers.
    True: dict(model=dict(MODEL, num_layers=1, d_model=32, num_heads=2,
                          seq_len=16), batch=8, replicas=(2,), rounds=2,
               steps=2, stages=("none", "weights")),
    False: dict(model=MODEL, batch=16, replicas=(1, 2, 4), rounds=3,
                steps=4, stages=STAGES),
}


def run(quick: bool = False) -> dict:
  """Runs the suite; returns {"rows": [...], "table": markdown}."""
  settings = SETTINGS[quick]
  rows = []
  for replicas in settings["replicas"]:
    rows += _replicas(replicas, settings)
  columns = ["replicas", "stage", "weights MB", "gradients MB",
             "optimizer MB", "held MB", "ZeRO MB", "padding MB",
             "transient MB", "RSS above fresh MB", "ex/s", "spread",
             "vs unsharded"]
  return {"rows": rows, "table": common.markdown_table(rows, columns)}


def _replicas(replicas: int, settings) -> List[Dict]:
  """The rows of one replica count: a process per stage."""
  server = socket.create_server(("127.0.0.1", 0))
  log_dir = tempfile.mkdtemp(prefix="memory_bench_")
  worker = [sys.executable, "-m", "tools.benchmarks.scale_worker",
            f"--driver=127.0.0.1:{server.getsockname()[1]}",
            f"--num_devices={replicas}"]
  groups = {}
  try:
    for stage in settings["stages"]:
      groups[stage] = Group(f"{replicas} replicas {stage}", server, worker,
                            1, log_dir)
    fresh = {s: g.ask(cmd="memory")[0]["peak_rss_mb"]
             for s, g in groups.items()}
    flat = dict(settings["model"], num_devices=replicas,
                global_batch_size=settings["batch"], train_steps=10**6)
    for stage, group in groups.items():
      group.ask(cmd="build", name=stage, flat=dict(flat, shard=stage),
                warmup=2)
    seconds = {s: [] for s in groups}
    for _ in range(settings["rounds"]):
      for stage, group in groups.items():
        seconds[stage].append(group.ask(cmd="train", name=stage,
                                        steps=settings["steps"])[0]["seconds"])
    memory = {s: g.ask(cmd="memory", name=s)[0] for s, g in groups.items()}
  finally:
    for group in groups.values():
      group.close()
    server.close()
  rows = []
  examples = settings["steps"] * settings["batch"]
  base = statistics.median(examples / s for s in seconds["none"])
  for stage in groups:
    rates = [examples / s for s in seconds[stage]]
    m = memory[stage]
    rows.append({
        "replicas": replicas, "stage": stage,
        "weights MB": m["memory/weights_mb"],
        "gradients MB": m["memory/gradients_mb"],
        "optimizer MB": m["memory/optimizer_mb"],
        "held MB": m["memory/held_mb"],
        "ZeRO MB": m["memory/zero_formula_mb"],
        "padding MB": m["memory/padding_mb"],
        "transient MB": m["memory/transient_mb"],
        "RSS above fresh MB": m["peak_rss_mb"] - fresh[stage],
        "ex/s": statistics.median(rates),
        "spread": common.spread(rates, "{:.0f}"),
        "vs unsharded": statistics.median(rates) / base})
  return rows


def main():
  print(run(quick="--quick" in sys.argv)["table"])


if __name__ == "__main__":
  main()
