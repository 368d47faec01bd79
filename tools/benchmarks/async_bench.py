r"""Async vs sync with a straggler: applied updates/sec and time to accuracy.

    python -m tools.benchmarks.async_bench [--quick]

Four workers (async) or four replicas (sync) on four logical CPU devices,
one of them a straggler at 1x (none), 3x and 10x (`--straggler=3:F`), the
seed CNN on `digits` (Adam 1e-3, batch 64). All six settings live in one
process and train interleaved, `CHUNK` updates each per round (the machines
are shared and noisy: interleaving gives every setting the same noise).
After each chunk a setting is evaluated. Reported per setting:

* updates/sec: `CHUNK` / the median chunk time (the first, tracing chunk
  excluded), and its ratio to sync at the same straggler factor;
* updates and seconds to the target eval accuracy: the setting's own
  training time until its first evaluation at or above the target
  (evaluation and the tracing chunk excluded);
* the mean staleness of the applied updates (async).

A benchmark, not a test: the numbers depend on the machine and its load.
"""

import argparse
import os
import statistics
from typing import Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # pylint: disable=g-import-not-at-top

from dist_loop.parallel.modes import Reporting  # pylint: disable=g-import-not-at-top
from dist_loop.runtime import devices  # pylint: disable=g-import-not-at-top
from tools.benchmarks import common  # pylint: disable=g-import-not-at-top

NUM_DEVICES = 4
FACTORS = (1, 3, 10)
MODES = ("sync", "async")
CHUNK = 25
MIN_ROUNDS = 6  # Enough chunks for a median, even for settings that are done.
SETTINGS = {  # quick: a smoke run of the harness; full: the numbers in docs/benchmarks.md.
    True: dict(model="mlp", target=0.90, max_steps=300),
    False: dict(model="cnn", target=0.95, max_steps=1000),
}


class _Setting(common.ChunkedRun):
  """One (mode, straggler factor): its trainer, evaluator and timings."""

  def __init__(self, mode: str, factor: int, model: str, split, names):
    self.mode, self.factor = mode, factor
    flat = _flags(model, mode)
    if factor > 1:
      flat["straggler"] = f"{NUM_DEVICES - 1}:{factor}"
    keras.utils.set_random_seed(flat["seed"])  # The same init everywhere.
    config, trainer = common.trainer(names, flat, split)
    super().__init__(trainer, split, config.eval_batch_size, CHUNK)

  def row(self, target: float) -> Dict[str, object]:
    return {
        "mode": self.mode, "straggler": self.factor, "target": target,
        "updates_per_sec": CHUNK / statistics.median(self.chunk_seconds),
        "steps_to_target": self.steps_to_target,
        "seconds_to_target": self.seconds_to_target,
        "eval_accuracy": self.accuracy,
        "staleness_mean": (self.trainer.summary().get("async_staleness_mean")
                           if isinstance(self.trainer, Reporting) else None
                           ) or 0.0,
    }


def _flags(model: str, mode: str) -> Dict[str, object]:
  """The flag values of one setting, without its straggler."""
  flat = dict(mode=mode, dataset="digits", model=model,
              num_devices=NUM_DEVICES, global_batch_size=64, optimizer="adam",
              learning_rate=1e-3, seed=0)
  if mode == "async":
    flat["async_workers"] = NUM_DEVICES
  return flat


def table(rows: List[Dict[str, object]]) -> str:
  """The rows as a markdown table, with async's speed-up over sync."""
  sync_rate = {r["straggler"]: r["updates_per_sec"] for r in rows
               if r["mode"] == "sync"}
  target = f"{rows[0]['target']:.0%}"
  lines = [f"| straggler | mode | updates/sec | vs sync | updates to {target} "
           f"| seconds to {target} | eval acc at end | mean staleness |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    slow = "none" if r["straggler"] == 1 else f"{r['straggler']}x"
    secs = r["seconds_to_target"]
    lines.append(
        f"| {slow} | {r['mode']} | {r['updates_per_sec']:.1f} "
        f"| {r['updates_per_sec'] / sync_rate[r['straggler']]:.2f}x "
        f"| {r['steps_to_target'] or 'not reached'} "
        f"| {'-' if secs is None else f'{secs:.1f}'} "
        f"| {r['eval_accuracy']:.3f} | {r['staleness_mean']:.2f} |")
  return "\n".join(lines)


def run(quick: bool = False) -> dict:
  """Trains every (straggler, mode) setting interleaved; rows and a table."""
  settings = SETTINGS[quick]
  names = devices.configure(NUM_DEVICES, "cpu")
  split = common.load_data(common.config(**_flags(settings["model"], "sync")))
  runs = [_Setting(mode, factor, settings["model"], split, names)
          for factor in FACTORS for mode in MODES]
  try:
    for round_ in range(settings["max_steps"] // CHUNK):
      for s in runs:
        s.train_chunk(settings["target"])
      if round_ + 1 >= MIN_ROUNDS and all(s.steps_to_target for s in runs):
        break
    rows = [s.row(settings["target"]) for s in runs]
  finally:
    for s in runs:
      s.trainer.close()
  return {"rows": rows, "table": table(rows)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="MLP, lower target: a smoke run of the harness.")
  print(run(parser.parse_args().quick)["table"])


if __name__ == "__main__":
  main()
