r"""Goodput: a checkpoint's blocking time, a run under repeated SIGKILLs,
and what start-up costs.

    python -m tools.bench --suite=goodput [--quick]
    python -m tools.benchmarks.goodput_bench [--quick]

1. **Blocking per save, synchronous against `--async_checkpoint`**, for the
   14M-parameter Transformer with Adam (8 blocks of 384; about 220 MB of
   checkpoint): one trainer, two `Checkpointer`s in their own directories,
   saves alternated with training; per save, the time training waited
   (median and spread). The last background save's wait is not counted: a
   run pays it once, at its end.
2. **Chaos:** `tools.launch --num_workers=2 --max_restarts=N` with one
   worker SIGKILLed every `kill_every_s` if the run trained since the last
   kill (so that restarts slower than the interval still end), at most
   `max_kills` times; goodput and
   its breakdown from the workdir's record (`dist_loop/runtime/goodput.py`).
3. **Start-up** of 1 and 2 processes, by phase, from the record of a short
   run (the chief's first attempt).

Each part runs real processes through the entry point, as a user's run
does, except the first, which needs the saves alone.
"""

import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from dist_loop.runtime import goodput  # pylint: disable=g-import-not-at-top
from tools.benchmarks import common  # pylint: disable=g-import-not-at-top

TRANSFORMER = dict(dataset="pysource", model="transformer", seq_len=64,
                   num_layers=8, d_model=384, num_heads=6, optimizer="adam",
                   learning_rate=1e-3, seed=0, global_batch_size=8)
SMALL = dict(dataset="synthetic", model="mlp", optimizer="adam",
             learning_rate=0.01, seed=0, global_batch_size=32)
SETTINGS = {  # quick: a smoke run of the harness; full: the docs' numbers.
    True: dict(save_model=dict(TRANSFORMER, num_layers=1, d_model=32,
                               num_heads=2, seq_len=16),
               saves=2, steps_between=2, chaos_model=SMALL,
               chaos_steps=600, kill_every_s=5.0, max_kills=1,
               max_restarts=2, checkpoint_every=100, startup_steps=5),
    False: dict(save_model=TRANSFORMER, saves=8, steps_between=20,
                chaos_model=dict(TRANSFORMER, num_layers=2, d_model=128,
                                 num_heads=4), chaos_steps=6000,
                kill_every_s=60.0, max_kills=20, max_restarts=20,
                checkpoint_every=100,
                startup_steps=20),
}
_ENTRY = [sys.executable, "-m", "experiments.train"]
_LAUNCH = [sys.executable, "-m", "tools.launch"]
_RUN_TIMEOUT_S = 1800


def run(quick: bool = False) -> dict:
  """Runs the suite; returns {"rows": [...], "table": markdown}."""
  settings = SETTINGS[quick]
  root = tempfile.mkdtemp(prefix="goodput_bench_")
  try:
    saves = _blocking(settings, root)
    chaos = _chaos(settings, root)
    startup = _startup(settings, root)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  table = "\n\n".join([
      common.markdown_table(saves, ["save", "blocking s", "spread",
                                    "vs sync"]),
      common.markdown_table(chaos, ["run", "kills", "attempts", "goodput",
                                    *goodput.PHASES, "downtime",
                                    "recomputed steps"]),
      common.markdown_table(startup, ["processes", *goodput.STARTUP,
                                      "restore", "total"])])
  return {"rows": saves + chaos + startup, "table": table}


def _blocking(settings, root: str) -> List[Dict]:
  """Per save, the seconds training waited: sync against async."""
  from dist_loop.runtime import checkpoints, devices  # pylint: disable=g-import-not-at-top
  device_names = devices.configure(1, "cpu")
  flat = dict(settings["save_model"], train_steps=10**6)
  _, trainer = common.trainer(device_names[:1], flat)
  try:
    savers = {
        kind: checkpoints.Checkpointer(
            trainer.checkpoint_items(), os.path.join(root, kind), 2,
            async_save=kind == "async")
        for kind in ("sync", "async")}
    times = {kind: [] for kind in savers}
    for _ in range(settings["saves"]):
      for kind, saver in savers.items():
        trainer.train(settings["steps_between"])
        step = int(trainer.step.numpy())
        t0 = time.perf_counter()
        saver.save(step)
        times[kind].append(time.perf_counter() - t0)
    savers["async"].wait()
  finally:
    trainer.close()
  # The first save of each builds (async: its host copy): not steady state.
  medians = {k: statistics.median(v[1:] or v) for k, v in times.items()}
  return [{"save": kind, "blocking s": medians[kind],
           "spread": common.spread(times[kind]),
           "vs sync": f"{medians['sync'] / max(medians[kind], 1e-9):.1f}x "
                      "less"}
          for kind in times]


def _flags(model, workdir: str, steps: int, every: int, *extra) -> List[str]:
  return [*(f"--{k}={v}" for k, v in model.items()),
          f"--workdir={workdir}", f"--train_steps={steps}",
          f"--checkpoint_every={every}", f"--log_every={every}",
          f"--eval_every={steps}", "--num_devices=1", *extra]


def _chaos(settings, root: str) -> List[Dict]:
  """Two workers under the launcher, one SIGKILLed every kill_every_s."""
  workdir = os.path.join(root, "chaos")
  proc = subprocess.Popen(
      [*_LAUNCH, "--num_workers=2",
       f"--max_restarts={settings['max_restarts']}",
       f"--timeout_s={_RUN_TIMEOUT_S}", "--", *_ENTRY,
       *_flags(settings["chaos_model"], workdir, settings["chaos_steps"],
               settings["checkpoint_every"], "--async_checkpoint")],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  kills = []
  stop = threading.Event()

  record = os.path.join(workdir, goodput.GOODPUT_FILE)

  def killer():
    rng, killed_at = random.Random(0), 0
    while not stop.wait(settings["kill_every_s"]):
      step = _furthest(record)
      workers = _children(proc.pid)
      if (workers and step > killed_at
          and len(kills) < settings["max_kills"]):
        os.kill(rng.choice(workers), signal.SIGKILL)
        kills.append(step)
        killed_at = step

  thread = threading.Thread(target=killer, daemon=True)
  thread.start()
  try:
    proc.wait(timeout=_RUN_TIMEOUT_S + 60)
  finally:
    stop.set()
    thread.join(timeout=10)
    proc.kill()
  attempts = goodput.read(os.path.join(workdir, goodput.GOODPUT_FILE))
  totals = goodput.totals(attempts)
  return [{"run": f"2 workers, SIGKILL every {settings['kill_every_s']:g} s",
           "kills": len(kills), "attempts": totals["attempts"],
           "goodput": totals["goodput"],
           **{p: totals[p] for p in (*goodput.PHASES, "downtime")},
           "recomputed steps": totals["recomputed_steps"]}]


def _furthest(record: str) -> int:
  """The furthest step the record shows, 0 before it has one."""
  try:
    return max((a["furthest"] for a in goodput.read(record)), default=0)
  except (OSError, goodput.CorruptRecord):
    return 0


def _children(pid: int) -> List[int]:
  """The launcher's child processes (its tasks)."""
  out = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", encoding="ascii") as f:
        if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
          out.append(int(entry))
    except (OSError, IndexError, ValueError):
      continue
  return out


def _startup(settings, root: str) -> List[Dict]:
  """Start-up phases of a short run in 1 and in 2 processes."""
  rows = []
  for processes in (1, 2):
    workdir = os.path.join(root, f"startup_{processes}")
    command = [*_ENTRY, *_flags(settings["chaos_model"], workdir,
                                settings["startup_steps"],
                                settings["startup_steps"])]
    if processes > 1:
      command = [*_LAUNCH, f"--num_workers={processes}", "--", *command]
    subprocess.run(command, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=_RUN_TIMEOUT_S,
                   check=True)
    first = goodput.read(os.path.join(workdir, goodput.GOODPUT_FILE))[0]
    phases = {p: first["phases"][p] for p in (*goodput.STARTUP, "restore")}
    rows.append({"processes": processes, **phases,
                 "total": sum(phases.values())})
  return rows


def main():
  print(run(quick="--quick" in sys.argv)["table"])


if __name__ == "__main__":
  main()
