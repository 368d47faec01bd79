r"""Pipeline benchmark: every schedule against the one-worker reference.

    python -m tools.bench --suite=pipeline [--quick]
    python -m tools.benchmarks.pipeline_bench [--quick] [--rounds=N] \
        [--out=rows.json] [--timeline=PATH]

The reference is one worker: sync on one device, one intra-op and one
inter-op thread; against it K stages reach at best M*K/(M+K-1), the
`ideal_speedup`. Sync on one device with both cores (intra-op 2) is what a
CPU user would otherwise run. Pipelines run `deep_mlp` at global batch 1024
(64-row micro-batches at M=16) with K=2 and K=4 stages (one intra-op and K
inter-op threads, at most one per core: see `_workers`), every schedule and
M in {4, 8, 16}, and 1F1B at M=1 (the
`speedup_vs_m1` base); a wider MLP compares the schedules at K=2, M=8.

Each thread setting is a worker process (`pipeline_worker.py`); the
workers take turns round by round (each idle while another measures); each
variant reports its median and min-max spread. A round times `--steps` untimed steps, then one timed
step (`--pipeline_timing=log`) gives the bubble and action durations.
Memory: the peak of the BFC CPU allocator (shared by the logical devices).
The prediction is the trainer's own, from the costs it measured at start.

The machine's own ceiling: two more one-worker processes (`deep_mlp`
only), each pinned to a core of its own, run their round at the same
time, after the others' turns. Two cores give `2 * alone / together`
times one core's throughput (`alone`: the one worker's step of the same
round), so K=2 stages on these cores can reach at most that over 2 of
their ideal speed-up; it is printed below the table, per round, median
and min-max, with 1F1B's shares at K=2 against it. (Where the cores share
caches, memory bandwidth or a clock that drops under load, it is under
2.)

The ideal's premise: a micro-batch costs 1/M of the batch. The one-worker
process also times the batch as M micro-batches summed one after the
other (`--grad_accum_steps=M`, at each M of the targets); that step over
the one worker's whole one, per round, is what a micro-batch costs beyond
its share on this machine's kernels, and 1F1B's share of the ideal against
that one worker (the same micro-batches, not pipelined) is printed beside
the targets, with the rest of that share (`microbatch_cost`): what 1F1B's
actions on a micro-batch cost against that one worker's, and how much of
its step (M+K-1) of them fill. Where that cost is: a Dense layer's three
products (forward, input and weight gradient) and the weight gradients'
sum, timed on the batch in M pieces against it whole, on one thread
pinned to a core after the workers are done (`pieces.py`), one line per M.

Below the table, the issue's targets, each met or not (or not measured,
as at `--quick`'s sizes). The share of the ideal speed-up is taken per
round, against the one worker's step of the same round (the machine's
load moves both), and judged by its median; its min-max over the rounds
follows it.
"""

import argparse
import json
import os
import statistics
from typing import Dict, List

from tools.benchmarks import pieces, pipeline_worker

GLOBAL_BATCH = 1024
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "auto")
# A wider MLP (`pipeline_worker.wide_mlp`), to compare the schedules.
WIDE = {"model": pipeline_worker.WIDE_MLP, "batch": 512, "m": 8}
ROUNDS, STEPS = 5, 6
# 1F1B at K=2 on deep_mlp: M -> the least share of the ideal speed-up.
SHARE_TARGETS = {8: 0.95, 16: 0.85}
# The one worker with the global batch as M micro-batches summed one after
# the other (`--grad_accum_steps`), at each M of the targets.
ACCUMULATED = "sync, one worker, accumulated"
COLUMNS = ("model", "schedule", "stages", "microbatches", "virtual_stages",
           "step_s_measured", "spread", "step_s_predicted",
           "speedup_vs_one_worker", "ideal_speedup", "speedup_vs_m1",
           "bubble_measured", "bubble_predicted", "peak_mb")


def _core_ids() -> List[int]:
  """The cores this process may run on (every core where the OS cannot
  say)."""
  return sorted(os.sched_getaffinity(0)) if hasattr(
      os, "sched_getaffinity") else list(range(os.cpu_count()))


def _cores() -> int:
  return len(_core_ids())


def _workers(quick: bool) -> List[Dict]:
  """One entry per worker process: its threads and its variants."""
  ms = (4,) if quick else (4, 8, 16)
  schedules = ("1f1b", "zb_h1") if quick else SCHEDULES
  deep = {"model": "deep_mlp", "batch": GLOBAL_BATCH}
  sync = [dict(deep, k=0, m=1, schedule="sync")] + (
      [] if quick else [dict(WIDE, k=0, m=1, schedule="sync")])
  accumulated = [] if quick else [
      dict(deep, k=0, m=m, schedule="sync", accum=m) for m in SHARE_TARGETS]
  out = [{"devices": 1, "intra": 1, "inter": 1,
          "variants": sync + accumulated},
         {"devices": 1, "intra": 2, "inter": 1, "variants": sync[:1],
          "label": "sync, 2 cores"}]
  for k in (2,) if quick else (2, 4):
    variants = [dict(deep, k=k, m=1, schedule="1f1b")] + [
        dict(deep, k=k, m=m, schedule=s) for s in schedules for m in ms]
    if k == 2 and not quick:
      variants += [dict(WIDE, k=k, schedule=s) for s in SCHEDULES]
    # One inter-op thread per stage, but no more threads than cores: on 2
    # cores 4 stages' threads would otherwise wait for the OS to give them
    # a core (time slices of milliseconds) at every hand-over; with 2
    # threads TensorFlow itself interleaves the stages' ops.
    out.append({"devices": k, "intra": 1, "inter": min(k, _cores()),
                "variants": variants})
  return out


def run(quick: bool = False, rounds: int = None, timeline_path: str = None,
        steps: int = STEPS) -> Dict:
  """Runs every variant; returns {"rows", "table", "targets", ...}."""
  rounds = rounds or (1 if quick else ROUNDS)
  workers = []
  for spec in _workers(quick):  # One at a time: each measures its costs.
    workers.append(pipeline_worker.Worker({**spec, "steps": steps}))
    assert workers[-1].ask(None) == "ready"
  twins = _pinned_twins(workers[0].spec, steps)
  measured = [[[] for _ in w.spec["variants"]] for w in workers]
  together = []  # Per round: the twins' deep_mlp steps, run at once.
  for _ in range(rounds):
    for w, store in zip(workers, measured):
      for i, row in enumerate(w.ask("round")):
        store[i].append(row)
    if twins:
      for w in twins:
        w.send("round")
      together.append([w.ask(None)[0]["s"] for w in twins])
  finals = [w.ask("done") for w in workers]
  for w in twins:
    w.ask("done")
  for w in workers + twins:
    w.close()
  rows = []
  for w, store, final in zip(workers, measured, finals):
    for variant, runs, info in zip(w.spec["variants"], store, final):
      rows.append(_row(w.spec, variant, runs, info))
  ref = {r["model"]: r["step_s_measured"] for r in rows
         if r["schedule"] == "sync, one worker"}
  m1 = {(r["model"], r["stages"]): r["step_s_measured"] for r in rows
        if r["microbatches"] == 1 and r["schedule"] == "1f1b"}
  for r in rows:
    r["speedup_vs_one_worker"] = ref[r["model"]] / r["step_s_measured"]
    base = m1.get((r["model"], r["stages"]))
    r["speedup_vs_m1"] = base / r["step_s_measured"] if base else None
  if timeline_path:
    _draw(rows, timeline_path)
  for r in rows:
    r.pop("bars", None)
  judged = targets(rows)
  ceiling = two_cores(rows, together)
  cost = microbatch_cost(rows)
  # Where a micro-batch's cost is: its kernels, alone on one core.
  kernels = pieces.measure_or_why(quick, core=_core_ids()[0] if hasattr(
      os, "sched_setaffinity") else None)
  return {"rows": rows, "table": table(rows) + "\n\n" + "\n".join(
      ceiling_lines(ceiling) + microbatch_lines(cost) + pieces.lines(kernels)
      + target_lines(judged)),
          "targets": judged, "two_cores": ceiling, "microbatch_cost": cost,
          "pieces": kernels,
          "global_batch": GLOBAL_BATCH,
          "rounds": rounds, "steps": steps}


def _pinned_twins(spec: Dict, steps: int) -> List:
  """Two one-worker processes of `deep_mlp` alone, each pinned (every
  thread) to a core of its own; none where there are fewer than 2 cores."""
  cores = _core_ids()
  if len(cores) < 2 or not hasattr(os, "sched_setaffinity"):
    return []
  twin = dict(spec, variants=spec["variants"][:1], steps=steps)
  twins = []
  for core in cores[:2]:
    twins.append(pipeline_worker.Worker(twin))
    assert twins[-1].ask(None) == "ready"
    # Its thread pools exist once it is ready; a thread made later
    # inherits the mask of the thread that makes it.
    for tid in os.listdir(f"/proc/{twins[-1].proc.pid}/task"):
      os.sched_setaffinity(int(tid), {core})
  return twins


def _one_worker(rows: List[Dict]):
  """`deep_mlp`'s one-worker row, the reference of the per-round ratios
  below (None if it was not measured)."""
  return next((r for r in rows if r["schedule"] == "sync, one worker"
               and r["model"] == "deep_mlp"), None)


def _is_1f1b_k2(row: Dict) -> bool:
  """Whether `row` is 1F1B on two stages of `deep_mlp`: the targets'."""
  return (row["schedule"], row["model"], row["stages"]) == ("1f1b",
                                                            "deep_mlp", 2)


def two_cores(rows: List[Dict], together: List[List[float]]) -> Dict:
  """Two cores' throughput over one core's, per round, from the twins'
  steps run at once (`together`) and the one worker's step alone in the
  same round; and 1F1B's K=2 shares of the ideal against its half."""
  alone = _one_worker(rows)
  if not together or alone is None:
    return {}
  ratios = [2 * a / statistics.mean(t)
            for a, t in zip(alone["step_s_rounds"], together)]
  out = {"throughput": ratios}
  for r in rows:
    if _is_1f1b_k2(r) and r["microbatches"] in SHARE_TARGETS:
      out[f"M={r['microbatches']}"] = [
          share / (ratio / 2) for share, ratio in
          zip(round_shares(r, alone), ratios)]
  return out


def ceiling_lines(ceiling: Dict) -> List[str]:
  """`two_cores` as lines, each a median and the rounds' min-max."""
  if not ceiling:
    return ["- two cores against one: not measured (fewer than 2 cores)"]
  lines = ["- two cores against one (two one-worker processes at once, "
           f"each pinned to a core): {_median_spread(ceiling['throughput'])}"
           "x the throughput; K=2's best share of the ideal is half that"]
  lines += [f"- 1f1b deep_mlp K=2 {m}: share of that best: "
            f"{_median_spread(shares)}"
            for m, shares in ceiling.items() if m != "throughput"]
  return lines


def microbatch_cost(rows: List[Dict]) -> Dict[int, Dict[str, List[float]]]:
  """What the ideal's premise costs: the one worker's step with the batch
  as M micro-batches (`ACCUMULATED`) over its step whole, per round; and
  1F1B's K=2 share of the ideal speed-up against that one worker, i.e.
  with micro-batches costing what they cost here. M -> {"cost", "shares"}
  (no "shares" without 1F1B's row).

  Where 1F1B's timed steps give its actions' durations, the rest of its
  share, by the rounds' medians: "actions", its slower stage's work on one
  micro-batch (every action of it, F and B) over that one worker's
  micro-batch split over the K stages (above 1: a pipelined action costs
  more than the same work unpipelined, as when the cores share caches,
  memory or a clock); and "schedule", (M+K-1) of those actions over its
  whole step (the schedule's own share: 1 for a step with no idle time
  beyond the ideal's bubble and no other work). Its share of the ideal is
  about schedule / (cost * actions)."""
  alone = _one_worker(rows)
  if alone is None:
    return {}
  pipes = {r["microbatches"]: r for r in rows if _is_1f1b_k2(r)}
  out = {}
  for r in rows:
    if (r["schedule"], r["model"]) != (ACCUMULATED, "deep_mlp"):
      continue
    m = r["microbatches"]
    cost = [whole_m / whole for whole_m, whole in
            zip(r["step_s_rounds"], alone["step_s_rounds"])]
    out[m] = {"cost": cost}
    if m in pipes:
      pipe = pipes[m]
      out[m]["shares"] = [share * c for share, c in
                          zip(round_shares(pipe, alone), cost)]
      if pipe.get("durations"):
        k = pipe["stages"]
        slower = max(sum(kinds.values())
                     for kinds in pipe["durations"].values())
        unpipelined = r["step_s_measured"] / m / k
        out[m].update(action_s=slower, actions=slower / unpipelined,
                      schedule=(m + k - 1) * slower / pipe["step_s_measured"])
  return out


def microbatch_lines(cost: Dict[int, Dict[str, List[float]]]) -> List[str]:
  """`microbatch_cost` as lines, each a median and the rounds' min-max;
  one line saying so where it was not measured (`--quick`)."""
  if not cost:
    return ["- one worker with the batch as micro-batches: not measured"]
  lines = []
  for m, values in sorted(cost.items()):
    lines.append(f"- one worker with the batch as M={m} micro-batches: "
                 f"{_median_spread(values['cost'])}x its step whole")
    if "shares" in values:
      lines.append(f"- 1f1b deep_mlp K=2 M={m} against that one worker: "
                   f"share of the ideal speed-up: "
                   f"{_median_spread(values['shares'])}")
    if "actions" in values:
      lines.append(
          f"- 1f1b deep_mlp K=2 M={m}: a micro-batch's actions on its slower "
          f"stage {values['action_s'] * 1e3:.2f} ms, {values['actions']:.3f}x "
          f"that one worker's micro-batch over the 2 stages; (M+K-1) of them "
          f"are {values['schedule']:.3f} of its step")
  return lines


def _median_spread(values: List[float]) -> str:
  return (f"{statistics.median(values):.3f} (rounds {min(values):.3f}-"
          f"{max(values):.3f})")


def _row(spec, variant, runs, info) -> Dict:
  seconds = [r["s"] for r in runs]
  bubbles = [r["bubble"] for r in runs if r["bubble"] is not None]
  k, m, name = variant["k"], variant["m"], variant["schedule"]
  if info and name == "auto":
    name = f"auto: {info['name']}"
  row = {"model": variant["model"], "stages": k or 1, "microbatches": m,
         "schedule": spec.get("label") or (
             name if k else ACCUMULATED if variant.get("accum")
             else "sync, one worker"),
         "virtual_stages": info["v"] if info else 1,
         "step_s_measured": statistics.median(seconds),
         "step_s_rounds": seconds,  # Round by round, for per-round ratios.
         "spread": f"{min(seconds):.3f}-{max(seconds):.3f}",
         "peak_mb": max(r["mb"] for r in runs),
         "bubble_measured": statistics.median(bubbles) if bubbles else None,
         # The timed step's schedule alone, first action to last (the
         # step also reads data and updates), for reference in the JSON;
         # the targets compare the prediction with the whole step.
         "span_s_measured": statistics.median(
             r["span"] for r in runs) if bubbles else None,
         "ideal_speedup": m * k / (m + k - 1) if k else None}
  if info:
    durations = {d: {k: statistics.median(r["durations"][d][k] for r in runs)
                     for k in kinds}  # Medians over the rounds' timed steps.
                 for d, kinds in runs[0]["durations"].items()}
    row.update(step_s_predicted=info["step_s"], bubble_predicted=info[
        "bubble"], predicted_peak_mb=info["peak_mb"], durations=durations,
               crowded=info["crowded"], bars=info["bars"])
  return row


def table(rows: List[Dict]) -> str:
  from tools.benchmarks import common  # pylint: disable=g-import-not-at-top
  return common.markdown_table(rows, COLUMNS)


def round_shares(row: Dict, reference: Dict) -> List[float]:
  """`row`'s share of its ideal speed-up in each round: the one worker's
  step of the same round (`reference`) over the row's, over the ideal."""
  return [ref / step / row["ideal_speedup"] for ref, step in
          zip(reference["step_s_rounds"], row["step_s_rounds"])]


def targets(rows: List[Dict]) -> Dict[str, object]:
  """The issue's targets: name -> (the numbers, whether it is met; None:
  not measured)."""
  pipe = {(r["schedule"], r["model"], r["stages"], r["microbatches"]): r
          for r in rows if "step_s_predicted" in r}
  one_worker = {r["model"]: r for r in rows
                if r["schedule"] == "sync, one worker"}
  out = {}
  for m, goal in SHARE_TARGETS.items():
    name = f"1f1b deep_mlp K=2 M={m}: share of the ideal speed-up >= {goal}"
    row, ref = pipe.get(("1f1b", "deep_mlp", 2, m)), one_worker.get(
        "deep_mlp")
    if row is None or ref is None:
      out[name] = ("not measured", None)
      continue
    shares = round_shares(row, ref)
    median = statistics.median(shares)
    out[name] = (f"{median:.3f} (rounds {min(shares):.3f}-"
                 f"{max(shares):.3f})", median >= goal)
  for (name, model, k, m), r in sorted(pipe.items()):
    where = f"{model} K={k} M={m}"
    whole = pipe.get(("1f1b", model, k, m))
    if name == "zb_h1" and r["bubble_measured"] is not None:
      bound = (k - 1) / (3 * m) + 0.03
      out[f"zb_h1 {where}: bubble <= {bound:.3f}"] = (
          round(r["bubble_measured"], 3), r["bubble_measured"] <= bound)
    if name == "zb_h1" and whole:
      worst = max(((d["I"] + d["W"]) / whole["durations"][dev]["B"]
                   for dev, d in r["durations"].items()),
                  key=lambda x: abs(x - 1))
      out[f"zb_h1 {where}: I+W within 10% of 1F1B's B, worst stage"] = (
          round(worst, 3), abs(worst - 1) <= 0.10)
    if name == "zb_h1" and r.get("crowded"):
      # The same, timed at start on equal terms: every chunk's I, W and B
      # beside the same actions on the other devices (the run's own B
      # times mix Bs that had a free core with Bs that had not).
      worst = max(((i + w) / b for _, i, w, b in r["crowded"]),
                  key=lambda x: abs(x - 1))
      out[f"zb_h1 {where}: crowded I+W within 10% of B, worst chunk"] = (
          round(worst, 3), abs(worst - 1) <= 0.10)
    if name.startswith("auto"):
      best = min(o["step_s_measured"] for key, o in pipe.items()
                 if not key[0].startswith("auto") and key[1:] == (model, k, m))
      slower = r["step_s_measured"] / best - 1
      out[f"{name} {where}: within 5% of the best fixed schedule"] = (
          f"{slower:+.1%}", slower <= 0.05)
  errors = {f"{key[0]} {key[1]} K={key[2]} M={key[3]}":
            r["step_s_predicted"] / r["step_s_measured"] - 1
            for key, r in pipe.items()}
  worst = max(errors, key=lambda k: abs(errors[k]))
  out["predicted step within 15% of measured, worst"] = (
      f"{worst}: {errors[worst]:+.1%}", abs(errors[worst]) <= 0.15)
  return out


def target_lines(judged: Dict[str, object]) -> List[str]:
  """`targets` as lines: "- name: numbers: met" (or NOT met); a target
  not measured says so alone."""
  return [f"- {name}: {value}" + ("" if met is None else
                                  f": {'met' if met else 'NOT met'}")
          for name, (value, met) in judged.items()]


def _draw(rows, path) -> None:
  """The measured K=2 timelines at the largest M, one above the other."""
  from dist_loop.parallel.modes.pipeline import timeline  # pylint: disable=g-import-not-at-top
  from dist_loop.parallel.modes.pipeline.schedule import Action  # pylint: disable=g-import-not-at-top
  drawn = [r for r in rows if r.get("bars") and r["stages"] == 2]
  m = max(r["microbatches"] for r in drawn)
  images = [timeline.render(
      [(d, Action(kind, int(label[1:])), s, e)
       for d, label, kind, s, e in r["bars"]], 2,
      title=f"{r['schedule'].split(':')[0]} {r['model']} M={m} "
      f"{1e3 * r['step_s_measured']:.0f} MS")
            for r in drawn if r["microbatches"] == m]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  timeline.write_png(path, timeline.stack(images))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--steps", type=int, default=STEPS)
  parser.add_argument("--timeline", default=None,
                      help="write the measured K=2, M=8 timelines as PNG")
  parser.add_argument("--out", default=None, help="write the rows as JSON")
  args = parser.parse_args(argv)
  result = run(args.quick, args.rounds, args.timeline, args.steps)
  print(result["table"])  # The targets below it.
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
