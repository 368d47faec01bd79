r"""Weak scaling across processes: does leaving one process pay?

    python -m tools.bench --suite=scale [--quick]
    python -m tools.benchmarks.scale_bench [--quick]

Per model, the per-worker batch is fixed and three process groups train it:

* **1 worker**: one process on one core (pinned), one device: the
  reference, compute alone;
* **2 workers**: two processes started by `tools.launch`, each pinned to a
  core of its own (`--cpus_per_task=1`), MultiWorkerMirroredStrategy over
  localhost gRPC;
* **in process**: one process on the same two cores with two logical
  devices (MirroredStrategy): the practical limit of this machine.

The groups stay alive for the whole suite and are driven over a socket
(`scale_worker.py`): in each round every group times every variant in
turn while the other groups wait idle, so noise is spread over all of them.
Per row: examples/s (median, min-max over the rounds), efficiency against
the ideal (2 x the 1-worker rate) and the 2-worker efficiency against the
in-process one. Per model, the step-time breakdown: compute alone (the
1-worker step), one all-reduce of the model's gradient bytes alone on each
transport (one bucket, and in buckets), and the exposed communication (the
2-worker step minus compute alone). Then the issue's targets, met or not.

Two more columns say what overlap can hide on this machine. `allreduce CPU
ms` is the CPU a worker spends on one all-reduce alone (gRPC copies and
reductions, all its threads): a worker pinned to one core has no other core
to run it on, so it adds to the step whatever the order of the collectives.
`exposed ms (DiLoCo)` is the 2-worker DiLoCo step minus compute alone: it
communicates once per H steps, so what it exposes is mostly the cost of two
workers running side by side (shared caches and memory bandwidth, the
slower one setting the pace at each sync), a floor under any synchronous
variant.

A full run takes about 40 minutes; `--models=deep_mlp,cnn` and
`--variants="float32, buckets;DiLoCo H=16"` (`;`-separated) time a subset
(the 1-worker reference is always timed).

The variants: float32 in one bucket (the reference) and in buckets of the
default size and of 1 MB (the choice of the default), bf16 on the wire,
PowerSGD, DiLoCo, and the three ZeRO stages (their cost in time; their
memory is `memory_bench.py`'s).
"""

import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.benchmarks import common  # pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
REPLY_TIMEOUT_S = 1800.0  # A build traces; a slow machine may take long.
DILOCO = dict(mode="local_sgd", outer_optimizer="nesterov",
              outer_learning_rate=0.7, outer_momentum=0.9, sync_every=16)
VARIANTS = {
    "float32, one bucket": dict(allreduce_bucket_mb=0),
    "float32, buckets": dict(),
    "float32, 1 MB buckets": dict(allreduce_bucket_mb=1),
    "bf16 wire, buckets": dict(allreduce_compression="bf16"),
    "powersgd r=4": dict(allreduce_compression="powersgd", powersgd_rank=4),
    "DiLoCo H=16": DILOCO,
    "ZeRO-1 (--shard=optimizer)": dict(shard="optimizer"),
    "ZeRO-2 (--shard=gradients)": dict(shard="gradients"),
    "ZeRO-3 (--shard=weights)": dict(shard="weights"),
}
REFERENCE = "float32, one bucket"  # The 1-worker group trains only this.
# name: (flags, per-worker batch, steps per timing: a multiple of H).
MODELS = {
    "cnn": (dict(dataset="digits", model="cnn"), 64, 96),
    "deep_mlp": (dict(dataset="digits", model="deep_mlp"), 512, 32),
    "transformer": (dict(dataset="pysource", model="transformer", seq_len=128,
                         num_layers=2, d_model=256, num_heads=4), 8, 16),
}
SETTINGS = {  # quick: a smoke run of the harness; full: the numbers in docs/benchmarks.md.
    True: dict(models={"mlp": (dict(dataset="synthetic", model="mlp"), 32,
                               16)},
               variants=("float32, one bucket", "float32, buckets",
                         "DiLoCo H=16"), rounds=2, warmup=16, reps=2),
    False: dict(models=MODELS, variants=tuple(VARIANTS), rounds=5,
                warmup=32, reps=10),
}
# (model, least 2-worker / in-process efficiency ratio) of the buckets.
TARGETS = {"cnn": 0.70, "deep_mlp": 0.85, "transformer": 0.85}


class Group:
  """Processes that receive the same commands and answer each."""

  def __init__(self, name: str, server: socket.socket,
               command: Sequence[str], tasks: int, log_dir: str, cpus=None):
    self.name = name
    self.log = os.path.join(log_dir, name.replace(" ", "_") + ".log")
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    with open(self.log, "w") as log:
      self.process = subprocess.Popen(
          list(command), cwd=REPO, preexec_fn=preexec, stdout=log,
          stderr=subprocess.STDOUT,
          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    self.streams = []
    server.settimeout(1.0)
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while len(self.streams) < tasks:
      try:
        conn, _ = server.accept()
      except socket.timeout:
        if self.process.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError(f"{name}: exited with code "
                             f"{self.process.poll()} before its tasks "
                             f"connected; see {self.log}") from None
        continue
      conn.settimeout(REPLY_TIMEOUT_S)
      stream = conn.makefile("rw")
      json.loads(stream.readline())  # Hello.
      self.streams.append(stream)

  def ask(self, **command) -> List[dict]:
    for stream in self.streams:
      stream.write(json.dumps(command) + "\n")
      stream.flush()
    replies = [json.loads(stream.readline() or "{}") for stream in
               self.streams]
    for reply in replies:
      if "error" in reply or not reply:
        raise RuntimeError(f"{self.name}: {reply.get('error', 'no reply')}; "
                           f"see {self.log}")
    return replies

  def close(self):
    with contextlib.suppress(OSError):
      for stream in self.streams:
        stream.write(json.dumps({"cmd": "exit"}) + "\n")
        stream.flush()
    try:
      self.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait(timeout=10)


def _start_groups(server, log_dir: str, groups: Dict[str, Group]) -> None:
  """Starts the three groups into `groups` (so a failure can stop the ones
  already started)."""
  worker = [sys.executable, "-m", "tools.benchmarks.scale_worker",
            f"--driver=127.0.0.1:{server.getsockname()[1]}"]
  groups["1 worker"] = Group("1 worker", server, worker + ["--threads=1"], 1,
                             log_dir, cpus={0})
  groups["2 workers"] = Group("2 workers", server, [
      sys.executable, "-m", "tools.launch", "--num_workers=2",
      "--cpus_per_task=1", f"--log_dir={log_dir}", "--", *worker,
      "--threads=1"], 2, log_dir)
  groups["in process"] = Group("in process", server, worker + [
      "--num_devices=2"], 1, log_dir, cpus={0, 1})


def _flat(model_flags, batch, workers, variant, steps) -> dict:
  return {**model_flags, **VARIANTS[variant], "global_batch_size":
          batch * workers, "num_devices": 1, "optimizer": "adam",
          "learning_rate": 1e-3, "train_steps": 100 * steps, "seed": 0}


def run(quick: bool = False, models: Sequence[str] = (),
        variants: Sequence[str] = ()) -> dict:
  """Runs the suite, or the named models and variants of it; returns
  {"rows": [...], "table": markdown}."""
  settings = _select(SETTINGS[quick], models, variants)
  if (os.cpu_count() or 1) < 2:
    raise RuntimeError("the scale suite pins two workers to two cores")
  server = socket.create_server(("127.0.0.1", 0))
  groups: Dict[str, Group] = {}
  try:
    _start_groups(server, tempfile.mkdtemp(prefix="scale_bench_"), groups)
    rows, breakdown = [], []
    for model, (flags, batch, steps) in settings["models"].items():
      t0 = time.monotonic()
      r, b = _model(groups, model, flags, batch, steps, settings)
      rows += r
      breakdown.append(b)
      # Progress: the suite takes most of an hour on two cores.
      print(f"scale: {model} done in {time.monotonic() - t0:.0f} s\n"
            + "\n".join(targets(r)), file=sys.stderr, flush=True)
  finally:
    for group in groups.values():
      group.close()
    server.close()
  table = "\n\n".join([
      common.markdown_table(rows, ["model", "variant", "1 worker ex/s",
                                   "2 workers ex/s", "2w spread",
                                   "in process ex/s", "ip spread",
                                   "efficiency 2w", "efficiency ip",
                                   "2w / ip"]),
      common.markdown_table(breakdown, [
          "model", "gradient MB", "compute ms", "allreduce ms (one)",
          "allreduce ms (buckets)", "allreduce CPU ms (one)",
          "allreduce CPU ms (buckets)", "2w step ms (one)",
          "2w step ms (buckets)", "exposed ms (one)", "exposed ms (buckets)",
          "exposed ms (DiLoCo)"]),
      "\n".join(targets(rows))])
  return {"rows": rows + breakdown, "table": table}


def _select(settings, models, variants) -> dict:
  """`settings` with only the named models and variants (all if none)."""
  for names, known in ((models, settings["models"]),
                       (variants, settings["variants"])):
    unknown = sorted(set(names) - set(known))
    if unknown:
      raise ValueError(f"unknown {', '.join(unknown)}: choose from "
                       f"{', '.join(known)}")
  return {**settings,
          "models": {m: v for m, v in settings["models"].items()
                     if not models or m in models},
          "variants": tuple(v for v in settings["variants"]
                            if not variants or v in variants)}


def _model(groups, model, flags, batch, steps, settings):
  """The rows and the breakdown of one model."""
  plan = {"1 worker": (1, (REFERENCE,)),
          "2 workers": (2, settings["variants"]),
          "in process": (2, settings["variants"])}
  for name, (workers, variants) in plan.items():
    for variant in variants:
      flat = _flat(flags, batch, workers, variant, steps)
      if name == "in process":
        flat["num_devices"] = 2
      groups[name].ask(cmd="build", name=f"{model}/{variant}", flat=flat,
                       warmup=settings["warmup"])
  seconds = {(g, v): [] for g, (_, vs) in plan.items() for v in vs}
  for _ in range(settings["rounds"]):
    for name, (_, variants) in plan.items():
      for variant in variants:
        replies = groups[name].ask(cmd="train", name=f"{model}/{variant}",
                                   steps=steps)
        seconds[(name, variant)].append(max(r["seconds"] for r in replies))
  rate = {k: [steps * batch * (1 if k[0] == "1 worker" else 2) / s
              for s in v] for k, v in seconds.items()}
  one = statistics.median(rate[("1 worker", REFERENCE)])
  rows = []
  for variant in settings["variants"]:
    two, local = rate[("2 workers", variant)], rate[("in process", variant)]
    row = {"model": model, "variant": variant, "1 worker ex/s": one,
           "2 workers ex/s": statistics.median(two),
           "2w spread": common.spread(two, "{:.0f}"),
           "in process ex/s": statistics.median(local),
           "ip spread": common.spread(local, "{:.0f}")}
    row["efficiency 2w"] = row["2 workers ex/s"] / (2 * one)
    row["efficiency ip"] = row["in process ex/s"] / (2 * one)
    row["2w / ip"] = row["efficiency 2w"] / row["efficiency ip"]
    rows.append(row)
  return rows, _breakdown(groups, model, batch, seconds, steps, settings)


def _breakdown(groups, model, batch, seconds, steps, settings):
  """Compute alone, the all-reduce alone, and what is left exposed."""
  del batch
  floats = _gradient_floats(groups, model)
  compute = 1e3 * statistics.median(seconds[("1 worker", REFERENCE)]) / steps
  out = {"model": model, "gradient MB": 4 * floats / 2**20,
         "compute ms": compute}
  bucket = _default_bucket_mb()
  for label, mb, variant in (("one", 0, "float32, one bucket"),
                             ("buckets", bucket, "float32, buckets")):
    reply = groups["2 workers"].ask(cmd="allreduce", floats=floats,
                                    bucket_mb=mb, reps=settings["reps"])
    out[f"allreduce ms ({label})"] = 1e3 * max(r["seconds"] for r in reply)
    out[f"allreduce CPU ms ({label})"] = 1e3 * max(r["cpu_seconds"]
                                                   for r in reply)
    if ("2 workers", variant) in seconds:
      step = 1e3 * statistics.median(seconds[("2 workers", variant)]) / steps
      out[f"2w step ms ({label})"] = step
      out[f"exposed ms ({label})"] = step - compute
  if ("2 workers", "DiLoCo H=16") in seconds:
    step = statistics.median(seconds[("2 workers", "DiLoCo H=16")]) / steps
    out["exposed ms (DiLoCo)"] = 1e3 * step - compute
  return out


def _gradient_floats(groups, model) -> int:
  reply = groups["1 worker"].ask(cmd="parameters",
                                 name=f"{model}/{REFERENCE}")
  return int(reply[0]["parameters"])


def _default_bucket_mb() -> float:
  from dist_loop.parallel.compression import BUCKET_MB  # pylint: disable=g-import-not-at-top
  return BUCKET_MB


def targets(rows: List[dict]) -> List[str]:
  """The issue's targets, each met or not."""
  lines = []
  by = {(r["model"], r["variant"]): r for r in rows if "variant" in r}
  for model, least in TARGETS.items():
    row = by.get((model, "float32, buckets"))
    if row:
      met = "met" if row["2w / ip"] >= least else "NOT met"
      lines.append(f"- {model}: 2-worker efficiency {row['efficiency 2w']:.2f}"
                   f" = {row['2w / ip']:.2f} of in-process "
                   f"{row['efficiency ip']:.2f} (target >= {least}): {met}")
  for model in TARGETS:
    base = by.get((model, "float32, one bucket"))
    for variant in ("powersgd r=4", "DiLoCo H=16"):
      row = by.get((model, variant))
      if row and base:
        met = ("met" if row["efficiency 2w"] >= base["efficiency ip"]
               else "NOT met")
        lines.append(f"- {model} {variant}: 2 workers {row['efficiency 2w']:.2f}"
                     f" vs float32 in process {base['efficiency ip']:.2f}: "
                     f"{met}")
  return lines


def main():
  args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if "=" in a)
  try:
    out = run(quick="--quick" in sys.argv,
              models=[m for m in args.get("models", "").split(",") if m],
              variants=[v for v in args.get("variants", "").split(";") if v])
  except ValueError as e:
    sys.exit(f"error: {e}")
  print(out["table"])


if __name__ == "__main__":
  main()
