r"""Data-parallel overhead: step time on 1, 2 and 4 devices, same global batch.

    python -m tools.benchmarks.data_parallel [--quick]

The seed CNN on digits, global batch 128, under `SyncTrainer`, on 1, 2 and 4
logical CPU devices; on 2 and 4 in one bucket and in buckets of `BUCKET_MB`
(`--allreduce_bucket_mb`), and with bf16 compression (`--quick`: the MLP, on
1 device and on 2 with both, 2 steps a loop). Logical CPU devices share the
same cores, so more of them do not add compute: the ratio to 1 device is the
price of splitting the batch, running replicas and all-reducing. On GPUs the
same table shows the scaling.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from dist_loop.runtime import devices  # pylint: disable=g-import-not-at-top
from tools.benchmarks.common import config, interleaved_medians, load_data, markdown_table, trainer  # pylint: disable=g-import-not-at-top

GLOBAL_BATCH = 128
STEPS_PER_LOOP = 20
BUCKET_MB = 0.25
VARIANTS = (  # (devices, bucket MB, compression)
    (1, 0, "none"),
    (2, 0, "none"), (2, BUCKET_MB, "none"), (2, 0, "bf16"),
    (4, 0, "none"), (4, BUCKET_MB, "none"), (4, 0, "bf16"),
)
QUICK_VARIANTS = ((1, 0, "none"), (2, BUCKET_MB, "bf16"))
# (steps per loop, loops per round, rounds), full and quick.
SIZES = {False: (STEPS_PER_LOOP, 5, 5), True: (2, 1, 1)}


def run(quick: bool = False) -> dict:
  names = devices.configure(4, "cpu")
  steps, loops, rounds = SIZES[quick]
  flat = dict(dataset="digits", model="mlp" if quick else "cnn",
              global_batch_size=GLOBAL_BATCH, optimizer="adam",
              steps_per_loop=steps)
  split = load_data(config(**flat))
  timed, trainers = {}, []
  for n, bucket, compression in QUICK_VARIANTS if quick else VARIANTS:
    _, sync = trainer(names[:n], dict(
        flat, num_devices=n, allreduce_bucket_mb=bucket,
        allreduce_compression=compression), split)
    sync.train(steps)  # Traces.
    trainers.append(sync)
    timed[(n, bucket, compression)] = (
        lambda t=sync: [t.train(steps) for _ in range(loops)])
  seconds = interleaved_medians(timed, rounds)
  for t in trainers:
    t.close()
  base = seconds[(1, 0, "none")]
  rows = []
  for (n, bucket, compression), s in seconds.items():
    step_ms = 1000 * s / (loops * steps)
    rows.append({"model": flat["model"], "devices": n, "bucket MB": bucket,
                 "compression": compression, "step ms": step_ms,
                 "vs 1 device": s / base})
  columns = ["devices", "bucket MB", "compression", "step ms",
             "vs 1 device"]
  return {"rows": rows, "table": markdown_table(rows, columns)}


if __name__ == "__main__":
  print(run(quick="--quick" in sys.argv)["table"])
