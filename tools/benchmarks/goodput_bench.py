r"""Goodput: a checkpoint's blocking time, a run under repeated SIGKILLs,
and what start-up costs, each against its target.

    python -m tools.bench --suite=goodput [--quick]
    python -m tools.benchmarks.goodput_bench [--quick]

1. **Blocking per save, synchronous against `--async_checkpoint`**, for the
   14M-parameter Transformer with Adam (8 blocks of 384; about 220 MB of
   checkpoint): one trainer, two `Checkpointer`s in their own directories,
   one save of each per round after a few training steps, in interleaved
   rounds (the order alternating), after two rounds that build (not
   counted: an async save's second one still builds); per save, the time
   training waited: the median over the rounds and its min-max spread.
   Each save is timed alone, with no background write in flight (untimed,
   the previous one is waited for): a run that saves more often than a
   write takes also waits for it, and the chaos run's `checkpoint` phase
   shows that. Target: async blocks at least 10x less than sync (the
   ratio of the medians).
2. **Chaos:** `tools.launch --num_workers=2 --cpus_per_task=1` (each worker
   pinned to its own core: multi-process speed is measured pinned; forked
   from the launcher's fork server, at each restart too) with
   `--max_restarts`, for `duration_s` (about 10 minutes), one worker
   SIGKILLed every `kill_every_s` (60 s) if the run trained since the last
   kill (so that restarts slower than the interval still end); then
   SIGTERM, which the launcher forwards. Goodput and its breakdown from the
   workdir's records (`dist_loop/runtime/goodput.py`; the downtime split by
   the launcher's record). Target: goodput of at least 0.80.
3. **Start-up** of 1 and 2 processes, each pinned to its own core, by
   phase, from the record of a short run (the chief's first attempt): the
   train command itself, and two tasks of `tools.launch`, which forks them
   from its fork server (their `import` is the fork to `train.run`;
   `tools/fork_server.py`). Target: the breakdown, shown.

Below the tables, one line per target says whether it was met. Each part
runs real processes through the entry point, as a user's run does, except
the first, which needs the saves alone. `--quick` runs every part at tiny
sizes and durations: a check of the harness, whose targets mean nothing.

Each process started here runs in a session of its own (a terminal's
Ctrl-C reaches the benchmark only) and dies with the benchmark
(PR_SET_PDEATHSIG; the launcher's fork server and tasks die with the
launcher). Stopped midway (an exception, such as `tools.bench`'s on Ctrl-C
or SIGTERM), a part SIGKILLs what it started and waits for all of it to go,
within `_KILL_WAIT_S`, before the temporary directory is removed.
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
from typing import Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from dist_loop.runtime import goodput, launch_record  # pylint: disable=g-import-not-at-top
from tools.benchmarks import common  # pylint: disable=g-import-not-at-top
from tools.local_cluster import die_with_parent  # pylint: disable=g-import-not-at-top

TRANSFORMER = dict(dataset="pysource", model="transformer", seq_len=64,
                   num_layers=8, d_model=384, num_heads=6, optimizer="adam",
                   learning_rate=1e-3, seed=0, global_batch_size=8)
SMALL = dict(dataset="synthetic", model="mlp", optimizer="adam",
             learning_rate=0.01, seed=0, global_batch_size=32)
SETTINGS = {  # quick: a smoke run of the harness; full: the docs' numbers.
    True: dict(save_model=dict(TRANSFORMER, num_layers=1, d_model=32,
                               num_heads=2, seq_len=16),
               rounds=2, steps_between=2, chaos_model=SMALL,
               duration_s=60.0, kill_every_s=10.0, max_kills=1,
               max_restarts=2, checkpoint_every=100, startup_steps=5),
    False: dict(save_model=TRANSFORMER, rounds=7, steps_between=20,
                chaos_model=dict(TRANSFORMER, num_layers=2, d_model=128,
                                 num_heads=4), duration_s=600.0,
                kill_every_s=60.0, max_kills=20, max_restarts=20,
                checkpoint_every=100, startup_steps=20),
}
TARGET_BLOCKING_RATIO = 10.0  # Async blocks at least this many times less.
TARGET_GOODPUT = 0.80  # Under the chaos run.
WORKERS = 2
_ENTRY = [sys.executable, "-m", "experiments.train"]
_LAUNCH = [sys.executable, "-m", "tools.launch"]
_RUN_TIMEOUT_S = 1800
_STOP_WAIT_S = 120  # SIGTERM to the launcher: its tasks save, then exit.
# SIGKILLed processes go at once; this only bounds a kernel that is slow
# to let them go (a process stuck in uninterruptible I/O).
_KILL_WAIT_S = 10
# Not timed: the first saves build (an async save's second one still does).
_WARMUP_ROUNDS = 2


def run(quick: bool = False) -> dict:
  """Runs the suite; returns {"rows": [...], "table": markdown}."""
  settings = SETTINGS[quick]
  cores = _cores()
  root = tempfile.mkdtemp(prefix="goodput_bench_")
  try:
    saves = _blocking(settings, root)
    chaos = _chaos(settings, root, cores)
    startup = _startup(settings, root, cores)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  table = "\n\n".join([
      common.markdown_table(saves, ["save", "rounds", "blocking s",
                                    "spread", "vs sync"]),
      common.markdown_table(chaos, ["run", "kills", "attempts", "goodput",
                                    *goodput.PHASES, "downtime",
                                    *(f"downtime_{p}" for p in
                                      goodput.DOWNTIME),
                                    "recomputed steps"]),
      common.markdown_table(startup, ["processes", "cores", "started",
                                      *goodput.STARTUP, "restore",
                                      "total"]),
      targets(saves, chaos, startup, settings, quick)])
  return {"rows": saves + chaos + startup, "table": table}


def targets(saves, chaos, startup, settings, quick: bool) -> str:
  """One line per target: met or not, with the measured value."""
  medians = {row["save"]: row["blocking s"] for row in saves}
  ratio = medians["sync"] / max(medians["async"], 1e-9)
  lines = ["Targets" + (" (--quick: tiny sizes, not the targets' setting)"
                        if quick else "") + ":"]
  met = _met(ratio >= TARGET_BLOCKING_RATIO)
  lines.append(
      f"- checkpoint blocking, async vs sync ({_model(settings)}): >= "
      f"{TARGET_BLOCKING_RATIO:g}x less: {met} ({ratio:.1f}x: "
      f"{medians['async']:.3g} s against {medians['sync']:.3g} s per save, "
      f"medians of {saves[0]['rounds']} interleaved rounds)")
  [chaos_run] = chaos
  if chaos_run.get("goodput") is None:
    lines.append(f"- goodput under chaos: >= {TARGET_GOODPUT:.2f}: not "
                 f"measured ({chaos_run['run']})")
  else:
    met = _met(chaos_run["goodput"] >= TARGET_GOODPUT)
    lines.append(f"- goodput under chaos ({chaos_run['run']}): >= "
                 f"{TARGET_GOODPUT:.2f}: {met} ({chaos_run['goodput']:.3f})")
  shown = [str(row["processes"]) for row in startup
           if row.get("total") is not None]
  met = _met(shown == ["1", "2"])
  lines.append(f"- start-up by phase for 1 and 2 processes: {met} (shown "
               f"for {' and '.join(shown) or 'none'})")
  return "\n".join(lines)


def _met(ok: bool) -> str:
  return "met" if ok else "NOT met"


def _model(settings) -> str:
  m = settings["save_model"]
  return (f"Transformer {m['num_layers']}x{m['d_model']}, "
          f"{m['optimizer']}")


def _cores() -> Optional[List[int]]:
  """One core per worker, or None where there are too few to pin."""
  available = sorted(os.sched_getaffinity(0)) if hasattr(
      os, "sched_getaffinity") else []
  return available[:WORKERS] if len(available) >= WORKERS else None


def _blocking(settings, root: str) -> List[Dict]:
  """Per save, the seconds training waited: sync against async, in
  interleaved rounds after the warm-up rounds."""
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
    for number in range(settings["rounds"] + _WARMUP_ROUNDS):
      order = list(savers) if number % 2 else list(reversed(savers))
      for kind in order:
        trainer.train(settings["steps_between"])
        step = int(trainer.step.numpy())
        savers["async"].wait()  # No write in the background: each alone.
        t0 = time.perf_counter()
        savers[kind].save(step)
        if number >= _WARMUP_ROUNDS:
          times[kind].append(time.perf_counter() - t0)
    savers["async"].wait()
  finally:
    trainer.close()
  medians = {k: statistics.median(v) for k, v in times.items()}
  return [{"save": kind, "rounds": len(times[kind]),
           "blocking s": medians[kind], "spread": common.spread(times[kind]),
           "vs sync": f"{medians['sync'] / max(medians[kind], 1e-9):.1f}x "
                      "less"}
          for kind in times]


def _flags(model, workdir: str, steps: int, every: int, *extra) -> List[str]:
  return [*(f"--{k}={v}" for k, v in model.items()),
          f"--workdir={workdir}", f"--train_steps={steps}",
          f"--checkpoint_every={every}", f"--log_every={every}",
          f"--eval_every={steps}", "--num_devices=1", *extra]


def _chaos(settings, root: str, cores) -> List[Dict]:
  """Two pinned workers under the launcher for `duration_s`, one SIGKILLed
  every `kill_every_s`; then SIGTERM."""
  name = (f"{WORKERS} workers on a core each, SIGKILL every "
          f"{settings['kill_every_s']:g} s, {settings['duration_s']:g} s")
  if cores is None:
    return [{"run": f"{name}: needs {WORKERS} cores to pin the workers"}]
  workdir = os.path.join(root, "chaos")
  proc = _start(
      [*_LAUNCH, f"--num_workers={WORKERS}", "--cpus_per_task=1",
       f"--max_restarts={settings['max_restarts']}",
       f"--timeout_s={_RUN_TIMEOUT_S}", "--", *_ENTRY,
       *_flags(settings["chaos_model"], workdir, 10**7,
               settings["checkpoint_every"], "--async_checkpoint")])
  kills = []
  stop = threading.Event()
  record = os.path.join(workdir, goodput.GOODPUT_FILE)

  def killer():
    rng, killed_at = random.Random(0), 0
    while not stop.wait(settings["kill_every_s"]):
      step = _furthest(record)
      workers = _tasks(proc.pid)
      if (workers and step > killed_at
          and len(kills) < settings["max_kills"]):
        os.kill(rng.choice(workers), signal.SIGKILL)
        kills.append(step)
        killed_at = step

  thread = threading.Thread(target=killer, daemon=True)
  thread.start()
  try:
    proc.wait(timeout=settings["duration_s"])
  except subprocess.TimeoutExpired:
    stop.set()
    thread.join(timeout=10)
    proc.send_signal(signal.SIGTERM)  # Forwarded: the tasks save.
    try:
      proc.wait(timeout=_STOP_WAIT_S)
    except subprocess.TimeoutExpired:
      pass  # Killed below.
  finally:
    stop.set()
    try:
      thread.join(timeout=10)
    finally:  # Even if a signal's exception cut the join short.
      _kill(proc)
  attempts = goodput.read(record)
  totals = goodput.totals(attempts, launch_record.read_if_any(
      launch_record.path(workdir)))
  return [{"run": name, "kills": len(kills), "attempts": totals["attempts"],
           "goodput": totals["goodput"],
           **{p: totals.get(p) for p in (
               *goodput.PHASES, "downtime",
               *(f"downtime_{p}" for p in goodput.DOWNTIME))},
           "recomputed steps": totals["recomputed_steps"]}]


def _furthest(record: str) -> int:
  """The furthest step the record shows, 0 before it has one."""
  try:
    return max((a["furthest"] for a in goodput.read(record)), default=0)
  except (OSError, goodput.CorruptRecord):
    return 0


def _tasks(launcher: int) -> List[int]:
  """The launcher's tasks: its child processes, but for its fork server
  (tools/fork_server.py), whose children (forked tasks) stand for it."""
  out = []
  for pid in _children(launcher):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        server = b"tools.fork_server" in f.read().split(b"\0")
    except OSError:
      continue
    out += _children(pid) if server else [pid]
  return out


def _start(command, cores=None) -> subprocess.Popen:
  """Starts `command` (on `cores`, if given) in a session of its own,
  to die with this process; its output is dropped."""

  def prepare():
    die_with_parent()
    if cores is not None:
      os.sched_setaffinity(0, cores)

  return subprocess.Popen(command, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                          start_new_session=True, preexec_fn=prepare)


def _kill(proc: subprocess.Popen) -> None:
  """SIGKILLs `proc` (a launcher, or a train command) if it still runs,
  its process group and every process under it (a fork server and its
  tasks), and waits, within _KILL_WAIT_S, for them all to go."""
  if proc.poll() is not None:
    return
  below = _descendants(proc.pid)  # Before it dies: they are orphans then.
  for kill, pid in [(os.killpg, proc.pid)] + [(os.kill, p) for p in below]:
    try:
      kill(pid, signal.SIGKILL)
    except OSError:
      pass  # Gone already.
  deadline = time.monotonic() + _KILL_WAIT_S
  try:
    proc.wait(timeout=_KILL_WAIT_S)
  except subprocess.TimeoutExpired:
    pass
  while (any(_running(p) for p in below)
         and time.monotonic() < deadline):
    time.sleep(0.05)


def _descendants(pid: int) -> List[int]:
  """Every running process under `pid`, each before its children."""
  out, todo = [], [pid]
  while todo:
    children = _children(todo.pop())
    out += children
    todo += children
  return out


def _running(pid: int) -> bool:
  """Whether `pid` is a process that has not exited (a zombie has)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (OSError, IndexError):
    return False


def _children(pid: int) -> List[int]:
  """The child processes of `pid` that still run (zombies left out)."""
  out = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      if int(fields[1]) == pid and fields[0] != "Z":
        out.append(int(entry))
    except (OSError, IndexError, ValueError):
      continue
  return out


def _startup(settings, root: str, cores) -> List[Dict]:
  """Start-up phases of a short run in 1 and in 2 processes, each on a
  core of its own."""
  if cores is None:
    return [{"processes": n, "cores": f"needs {WORKERS} to pin"}
            for n in (1, 2)]
  rows = []
  for processes in (1, 2):
    workdir = os.path.join(root, f"startup_{processes}")
    command = [*_ENTRY, *_flags(settings["chaos_model"], workdir,
                                settings["startup_steps"],
                                settings["startup_steps"])]
    if processes > 1:  # The launcher pins each task.
      command = [*_LAUNCH, f"--num_workers={processes}", "--cpus_per_task=1",
                 "--", *command]
    proc = _start(command, None if processes > 1 else [cores[0]])
    try:
      code = proc.wait(timeout=_RUN_TIMEOUT_S)
    finally:
      _kill(proc)
    if code:
      raise subprocess.CalledProcessError(code, command)
    first = goodput.read(os.path.join(workdir, goodput.GOODPUT_FILE))[0]
    phases = {p: first["phases"][p] for p in (*goodput.STARTUP, "restore")}
    rows.append({"processes": processes, "cores": "1 each",
                 "started": ("forked by tools.launch" if processes > 1
                             else "a new process"),
                 **phases, "total": sum(phases.values())})
  return rows


def main():
  print(run(quick="--quick" in sys.argv)["table"])


if __name__ == "__main__":
  main()
