"""The benchmark harness: its arithmetic, and a quick run's JSON.

Speed is not asserted (that is what tools/bench is for): the quick run
checks that the in-process suites run end to end on today's APIs and that
every number they derive agrees with the numbers it is derived from.
"""

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from tools.benchmarks import common, goodput_bench, mfu


def test_mfu_flop_count_matches_hand_count():
  # 2 -> 3 -> 4 with batch 5: first layer forward + dW only.
  first = 2 * 5 * 2 * 3
  second = 2 * 5 * 3 * 4
  assert mfu.train_flops_per_step(5, [2, 3, 4]) == 2 * first + 3 * second


def test_transformer_flop_count_matches_hand_count():
  # B=2, T=3, one block of d=4, MLP ratio 2, vocabulary 5.
  qkvo = 4 * 2 * 4 * 4
  mlp = 2 * 2 * 4 * 8
  attention = 2 * 2 * 3 * 4  # Scores and values, per token.
  head = 2 * 4 * 5
  assert mfu.transformer_flops_per_step(2, 3, 1, 4, mlp_ratio=2, vocab=5) == (
      3 * 2 * 3 * (qkvo + mlp + attention + head))


def test_variants_are_timed_interleaved_and_reported_by_median():
  calls = []
  clock = iter(range(100))
  # Each call takes one tick, except b's second, which takes three.
  ticks = {"a": [0, 0, 0], "b": [0, 2, 0]}

  def variant(name):
    def fn():
      calls.append(name)
      for _ in range(ticks[name].pop(0)):
        next(clock)
    return fn

  medians = common.interleaved_medians(
      {"a": variant("a"), "b": variant("b")}, rounds=3,
      clock=lambda: next(clock))
  assert calls == ["a", "b", "a", "b", "a", "b"]
  assert medians == {"a": 1, "b": 1}


def test_interleaved_times_keep_every_round_for_the_spread():
  clock = itertools.count()
  times = common.interleaved_times({"a": lambda: next(clock),
                                    "b": lambda: None}, rounds=2,
                                   clock=lambda: next(clock))
  assert times == {"a": [2, 2], "b": [1, 1]}
  assert common.spread([0.5, 0.25, 2.0]) == "0.25-2"
  assert common.spread([1.234, 5.678], "{:.1f}") == "1.2-5.7"


def test_markdown_table_formats_cells():
  table = common.markdown_table(
      [{"n": 1, "rate": 12345.6, "ratio": 0.123456, "note": None}],
      ["n", "rate", "ratio", "note"])
  assert table.splitlines() == ["| n | rate | ratio | note |",
                                "| --- | --- | --- | --- |",
                                "| 1 | 12,346 | 0.123 |  |"]


def _positive(value):
  return isinstance(value, float) and math.isfinite(value) and value > 0


def test_quick_suites_write_consistent_json(tmp_path):
  # In a process of its own, as users run it: the suites leave Keras fit's
  # multi-device iterators behind, and their destruction, whenever the
  # garbage collector gets to it, stalls whatever test runs next. Without
  # the TF_CPP_MIN_LOG_LEVEL that conftest sets here: a user's shell has none.
  # The data_parallel suite's quick run is checked in test_quiet_tools.py,
  # where it runs at --verbosity=2 (each suite runs once).
  out = tmp_path / "bench.json"
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  result = subprocess.run(
      [sys.executable, "-m", "tools.bench", "--quick",
       "--suite=overhead,mfu", f"--out={out}"],
      cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"wrote {out}" in result.stdout
  # Only its own lines, all on stdout: none of TensorFlow's or Keras's
  # (Keras fit's warnings, the strategies' INFO lines, native start-up
  # lines; test_quiet_tools.py: --verbosity=2 brings them back).
  assert result.stderr == "", result.stderr[-3000:]
  results = json.loads(out.read_text())
  assert results["quick"] is True
  assert results["machine"]["cpu_count"] == os.cpu_count()
  suites = results["suites"]
  assert sorted(suites) == ["mfu", "overhead"]
  targets = {}
  for name, suite in suites.items():
    assert _positive(suite["seconds"]), name
    # A header, a rule, and one line per row, then the targets; each
    # printed under its name.
    table, lines = suite["table"].split("\n\n")
    assert len(table.splitlines()) == len(suite["rows"]) + 2, name
    targets[name] = lines.splitlines()
    assert f"## {name} (" in result.stdout
    assert suite["table"] in result.stdout

  overhead = suites["overhead"]["rows"]
  # Quick: each model and each device count once; on 1 device fit runs
  # our steps_per_loop per execution, on 2 one (keras-team/keras#19246).
  assert [(r["model"], r["devices"], r["steps_per_loop"],
           r["fit steps_per_execution"]) for r in overhead] == [
               ("mlp", 2, 2, 1), ("transformer", 1, 2, 2)]
  for r in overhead:
    assert all(_positive(r[k]) for k in
               ("dist_loop ex/s", "keras_fit ex/s", "bare ex/s"))
    assert r["vs fit"] == pytest.approx(r["dist_loop ex/s"]
                                        / r["keras_fit ex/s"])
    assert r["vs bare"] == pytest.approx(r["dist_loop ex/s"] / r["bare ex/s"])
    assert r["xla vs none"] == pytest.approx(r["dist_loop_xla ex/s"]
                                             / r["dist_loop ex/s"])
    # fit with XLA is the reference on one device only.
    if r["devices"] == 1:
      assert r["xla vs fit xla"] == pytest.approx(
          r["dist_loop_xla ex/s"] / r["keras_fit_xla ex/s"])
    else:
      assert r["keras_fit_xla ex/s"] is None
  # Its target: on one device, with XLA at least as fast as fit with XLA.
  (one,) = [r for r in overhead if r["devices"] == 1]
  (line,) = targets["overhead"]
  assert line == (
      f"- transformer, 1 device: dist_loop_xla {one['xla vs fit xla']:.3f}x "
      f"keras_fit_xla ({one['xla vs fit xla spread']}) (target >= 1.0): "
      + ("met" if one["xla vs fit xla"] >= 1.0 else "NOT met"))

  rows = suites["mfu"]["rows"]
  # The model (quick: the Transformer only): sync on 1 and 2 devices
  # without and with XLA, then fit with XLA on one device, its reference.
  assert [(r["model"].split(",")[0], r["loop"], r["xla"]) for r in rows] == [
      ("Transformer L=1 d=32 T=16", loop, xla)
      for loop, xla in (("sync 1 device", False), ("sync 1 device", True),
                        ("sync 2 devices", False), ("sync 2 devices", True),
                        ("keras fit 1 device", True))]
  for row in rows:
    assert _positive(row["train GFLOP/s"]) and _positive(
        row["matmul peak GFLOP/s"])
    assert row["MFU"] == pytest.approx(row["train GFLOP/s"]
                                       / row["matmul peak GFLOP/s"])
    # Compile time: the first call (traced, with XLA compiled) less a
    # steady one of the same steps, which does neither.
    assert 0 < row["compile s"] < row["first loop s"]
  fit = rows[4]
  assert fit["vs fit xla"] == 1.0
  for row in rows[:4]:
    assert row["vs fit xla"] == pytest.approx(row["train GFLOP/s"]
                                              / fit["train GFLOP/s"])
  # The targets: every sync row's MFU (MLP 0.85, Transformer 0.70), then
  # each model's one-device XLA loop against fit with XLA (1.0x).
  # First, XLA's own chain of matmuls against the peak's, per round.
  ceiling = suites["mfu"]["xla_matmul"]
  assert _positive(ceiling["of peak"])
  first, *lines = targets["mfu"]
  assert first == mfu.ceiling_line(ceiling)
  assert first.startswith(
      f"- the same chain of matmuls compiled with XLA: {ceiling['of peak']:.3f}"
      f" ({ceiling['spread']}) of the peak")
  ours = [r for r in rows if r["loop"] != "keras fit 1 device"]
  assert len(lines) == len(ours) + 1
  for line, row in zip(lines, ours):
    least = 0.70  # The Transformer's (the MLP's: the next test).
    assert line.startswith(f"- {row['model']}, {row['loop']}, ")
    assert f"MFU {row['MFU']:.3f} ({row['MFU spread']})" in line
    assert line.endswith(f"(target >= {least}): "
                         + ("met" if row["MFU"] >= least else "NOT met"))
  for line, row in zip(lines[-1:], [rows[1]]):
    assert (row["loop"], row["xla"]) == ("sync 1 device", True)
    assert f"{row['vs fit xla']:.3f}x Keras fit with XLA" in line
    assert line.endswith("(target >= 1.0): " + (
        "met" if row["vs fit xla"] >= 1.0 else "NOT met"))


def _bench(*args, **kwargs) -> subprocess.Popen:
  """tools.bench, in a process group of its own (`_ended` ends it)."""
  return subprocess.Popen([sys.executable, "-m", "tools.bench", *args],
                          cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **kwargs)


def _ended(bench: subprocess.Popen, timeout=60):
  """(stdout, stderr) of `bench` once it exits; if it does not within
  `timeout`, or the test fails meanwhile, its process group is killed."""
  try:
    return bench.communicate(timeout=timeout)
  finally:
    _kill(bench)


def _kill(bench: subprocess.Popen) -> None:
  if bench.poll() is None:
    os.killpg(bench.pid, signal.SIGKILL)  # The rest die with it.
    bench.wait()


@pytest.mark.parametrize("out, problem", [
    ("", "not a file name"),
    ("{tmp}", "is a directory"),
    ("{tmp}/", "not a file name"),
    ("{tmp}/fifo", "is not a regular file (a FIFO, a socket or a device)"),
    ("{tmp}/file/bench.json", "{tmp}/file is not a directory"),
])
def test_a_bad_out_is_refused_before_any_suite_runs(tmp_path, out, problem):
  os.mkfifo(tmp_path / "fifo")
  (tmp_path / "file").write_text("kept")
  out, problem = (s.format(tmp=tmp_path) for s in (out, problem))
  before = sorted(tmp_path.iterdir())
  _, err = _ended(_bench("--quick", "--suite=memory", f"--out={out}"))
  # absl's one line (and its pointer to --helpfull), nothing run, nothing
  # written: the FIFO would have blocked a suite's write.
  assert err.splitlines()[0] == (
      f"FATAL Flags parsing error: flag --out={out}: {problem}; name a JSON "
      "file, e.g. --out=bench.json"), err
  assert sorted(tmp_path.iterdir()) == before
  assert (tmp_path / "file").read_text() == "kept"


def test_a_stray_argument_is_refused_in_one_line(tmp_path):
  """`tools.bench overhead` (no --suite=) runs nothing, overwrites
  nothing."""
  out = tmp_path / "bench.json"
  out.write_text("kept")
  bench = _bench("--quick", f"--out={out}", "overhead", "mfu")
  stdout, err = _ended(bench)
  assert (bench.returncode, stdout) == (1, "")
  assert err == ("error: unexpected arguments: overhead mfu; every setting "
                 "is a --flag (suites: --suite=overhead,mfu)\n")
  assert out.read_text() == "kept"


@pytest.mark.skipif(goodput_bench._cores() is None,  # pylint: disable=protected-access
                    reason="the chaos run needs 2 cores to pin its workers")
def test_sigterm_stops_the_goodput_cluster_and_removes_its_files(tmp_path):
  """SIGTERM (what `timeout` sends) once the chaos run's launcher has
  forked its two workers: one line, exit code 143, and nothing the
  benchmark started is left, neither a process nor its temporary
  directory."""
  temp = tmp_path / "tmp"
  temp.mkdir()
  out = tmp_path / "bench.json"
  bench = _bench("--quick", "--suite=goodput", f"--out={out}",
                 env=dict(os.environ, TMPDIR=str(temp)))
  try:
    tree, deadline = [], time.monotonic() + 300
    while not tree and bench.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
      for pid in goodput_bench._descendants(bench.pid):  # pylint: disable=protected-access
        if len(goodput_bench._tasks(pid)) == 2:  # pylint: disable=protected-access
          tree = goodput_bench._descendants(bench.pid)  # pylint: disable=protected-access
    assert tree, "the chaos run's launcher did not fork its workers"
    assert len(list(temp.glob("goodput_bench_*"))) == 1
    bench.send_signal(signal.SIGTERM)
    stdout, err = _ended(bench)
  finally:
    _kill(bench)
  assert bench.returncode == 143, err[-3000:]
  # After the checkpoint part's lines, one line; no traceback.
  assert err.endswith(f"\nerror: interrupted (SIGTERM); no suite finished; "
                      f"{out} was not written\n"), err[-3000:]
  assert "Traceback" not in err
  assert "goodput" not in stdout
  # Launcher, fork server and workers: gone by the time the bench exits.
  assert len(tree) >= 4
  assert [p for p in tree if goodput_bench._running(p)] == []  # pylint: disable=protected-access
  assert list(temp.glob("goodput_bench_*")) == [] and not out.exists()


def test_mfu_targets_are_each_models_own():
  def row(name, loop, xla, value, vs_fit=1.0):
    return {"name": name, "model": name.upper(), "loop": loop, "xla": xla,
            "MFU": value, "MFU spread": "s", "vs fit xla": vs_fit,
            "vs fit xla spread": "f"}

  lines = mfu.targets([
      row("mlp", "sync 1 device", True, 0.86, vs_fit=0.9),
      row("mlp", "sync 2 devices", False, 0.84),
      row("transformer", "sync 1 device", True, 0.71, vs_fit=1.2),
      row("transformer", mfu.FIT, True, 0.5)])
  assert lines == [
      "- MLP, sync 1 device, XLA: MFU 0.860 (s) (target >= 0.85): met",
      "- MLP, sync 2 devices, no XLA: MFU 0.840 (s) (target >= 0.85): "
      "NOT met",
      "- TRANSFORMER, sync 1 device, XLA: MFU 0.710 (s) (target >= 0.7): "
      "met",
      "- MLP, sync 1 device, XLA: 0.900x Keras fit with XLA (f) "
      "(target >= 1.0): NOT met",
      "- TRANSFORMER, sync 1 device, XLA: 1.200x Keras fit with XLA (f) "
      "(target >= 1.0): met"]


@pytest.mark.parametrize("jit_compile", [False, True], ids=["tf", "xla"])
def test_a_profiled_step_names_its_top_ops(tmp_path, jit_compile):
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tools.benchmarks import profile_step  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((64,)),
                            keras.layers.Dense(64, activation="relu"),
                            keras.layers.Dense(10)])
  x, y = tf.random.normal([32, 64]), tf.zeros([32], tf.int32)

  @tf.function(jit_compile=jit_compile, autograph=False)
  def step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
          y, model(x, training=True), from_logits=True))
    for v, g in zip(model.trainable_variables,
                    tape.gradient(loss, model.trainable_variables)):
      v.assign_sub(0.1 * g)

  path = profile_step.capture(step, str(tmp_path / "profile"))
  assert path.endswith(".xplane.pb") and str(tmp_path) in path
  ops = profile_step.top_ops(path)
  assert 0 < len(ops) <= profile_step.TOP
  assert all(o.seconds > 0 and o.count > 0 for o in ops)
  assert [o.seconds for o in ops] == sorted((o.seconds for o in ops),
                                            reverse=True)
  assert 0 < sum(o.share for o in ops) <= 1 + 1e-9
  # The layers' matmuls, as TensorFlow kernels (oneDNN's where TensorFlow
  # rewrites them: its default on x86 CPUs with AVX512_VNNI, AVX512_BF16,
  # AVX_VNNI or AMX) or XLA instructions.
  matmuls = [o for o in ops if o.name in ("MatMul", "_MklMatMul")]
  assert [o.xla for o in matmuls] == [jit_compile]
  assert matmuls[0].count >= 2  # Both layers' forward, at least.
  table = profile_step.table(ops)
  assert len(table.splitlines()) == len(ops) + 2
  assert f"| {matmuls[0].name} |" in table


def test_self_time_leaves_out_the_ops_nested_in_an_op(tmp_path):
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
  from tools.benchmarks import profile_step  # pylint: disable=g-import-not-at-top
  space = xplane_pb2.XSpace()
  plane = space.planes.add(name="/host:CPU")
  plane.stat_metadata[1].name = "hlo_op"
  names = {1: ("outer:While", "While"), 2: ("mm:MatMul", "MatMul"),
           3: ("__inference_f:__inference_f", "__inference_f"),
           4: ("MatMul.7", ""), 5: ("ExecutorState::Process", "")}
  for i, (name, display) in names.items():
    plane.event_metadata[i].name = name
    plane.event_metadata[i].display_name = display
  line = plane.lines.add(name="tf_Compute")
  # (metadata, start, duration) in picoseconds: a While holding a MatMul
  # and an XLA instruction, inside a function call and another event.
  for meta, start, duration in [(5, 0, 10**9), (3, 0, 10**9),
                                (1, 10**6, 10**8), (2, 2 * 10**6, 3 * 10**7),
                                (4, 5 * 10**7, 10**7), (2, 2 * 10**8, 10**7)]:
    event = line.events.add(metadata_id=meta, offset_ps=start,
                            duration_ps=duration)
    if meta == 4:
      event.stats.add(metadata_id=1, str_value="MatMul.7")
  path = tmp_path / "host.xplane.pb"
  path.write_bytes(space.SerializeToString())
  ops = {(o.name, o.xla): (round(o.seconds * 1e12), o.count)
         for o in profile_step.top_ops(str(path))}
  assert ops == {("While", False): (10**8 - 3 * 10**7 - 10**7, 1),
                 ("MatMul", False): (3 * 10**7 + 10**7, 2),
                 ("MatMul", True): (10**7, 1)}


def test_pipeline_targets_are_judged_from_the_rows():
  from tools.benchmarks import pipeline_bench  # pylint: disable=g-import-not-at-top

  def row(schedule, m, step, predicted, rounds=None, **extra):
    return {"schedule": schedule, "model": "deep_mlp", "stages": 2,
            "microbatches": m, "step_s_measured": step,
            "step_s_rounds": rounds or [step] * 3,
            "step_s_predicted": predicted, "ideal_speedup": 2 * m / (m + 1),
            "speedup_vs_one_worker": 0.1 / step, "bubble_measured": 0.05,
            **extra}

  # The one worker's rounds: the second ran on a slower machine.
  one_worker = {"schedule": "sync, one worker", "model": "deep_mlp",
                "stages": 1, "microbatches": 1, "step_s_measured": 0.1,
                "step_s_rounds": [0.1, 0.13, 0.1]}
  b = {"0": {"F": 1.0, "B": 2.0}, "1": {"F": 1.0, "B": 2.0}}
  iw = {"0": {"F": 1.0, "I": 1.0, "W": 1.15}, "1": {"F": 1, "I": 1, "W": 1}}
  rows = [one_worker,
          row("1f1b", 8, 0.065, 0.06, [0.05, 0.065, 0.07], durations=b),
          row("1f1b", 16, 0.08, 0.06, [0.08, 0.08, 0.09], durations=b),
          row("zb_h1", 8, 0.05, 0.05, durations=iw,
              crowded=[(1.0, 1.0, 1.0, 2.0), (1.0, 1.18, 1.0, 2.0)]),
          row("auto: zb_h1", 8, 0.0515, 0.05)]
  out = pipeline_bench.targets(rows)
  # Per round, against the same round's one worker: M=8 runs 2.0, 2.0 and
  # 1.43x one worker, 1.125, 1.125 and 0.804 of the ideal 1.78 (from the
  # medians alone, 0.1/0.065, it would be 0.865: not met); M=16 runs 1.25,
  # 1.625 and 1.11x, 0.664, 0.863 and 0.590 of 1.88.
  assert out["1f1b deep_mlp K=2 M=8: share of the ideal speed-up >= 0.95"] == (
      "1.125 (rounds 0.804-1.125)", True)
  assert out["1f1b deep_mlp K=2 M=16: share of the ideal speed-up >= "
             "0.85"] == ("0.664 (rounds 0.590-0.863)", False)
  assert out["zb_h1 deep_mlp K=2 M=8: bubble <= 0.072"] == (0.05, True)
  assert out["zb_h1 deep_mlp K=2 M=8: I+W within 10% of 1F1B's B, "
             "worst stage"] == (1.075, True)
  assert out["zb_h1 deep_mlp K=2 M=8: crowded I+W within 10% of B, "
             "worst chunk"] == (1.09, True)
  assert out["auto: zb_h1 deep_mlp K=2 M=8: within 5% of the best fixed "
             "schedule"] == ("+3.0%", True)
  assert out["predicted step within 15% of measured, worst"] == (
      "1f1b deep_mlp K=2 M=16: -25.0%", False)
  # Printed below the table, each met or not; one not measured says so.
  lines = pipeline_bench.target_lines(pipeline_bench.targets(
      [r for r in rows if r.get("microbatches") != 16]))
  assert lines[:2] == [
      "- 1f1b deep_mlp K=2 M=8: share of the ideal speed-up >= 0.95: "
      "1.125 (rounds 0.804-1.125): met",
      "- 1f1b deep_mlp K=2 M=16: share of the ideal speed-up >= 0.85: "
      "not measured"]
  assert lines[-1] == ("- predicted step within 15% of measured, worst: "
                       "1f1b deep_mlp K=2 M=8: -7.7%: met")


def test_pipeline_two_core_ceiling_is_per_round():
  from tools.benchmarks import pipeline_bench  # pylint: disable=g-import-not-at-top
  one_worker = {"schedule": "sync, one worker", "model": "deep_mlp",
                "stages": 1, "microbatches": 1, "step_s_rounds": [0.1, 0.2]}
  m8 = {"schedule": "1f1b", "model": "deep_mlp", "stages": 2,
        "microbatches": 8, "ideal_speedup": 16 / 9,
        "step_s_rounds": [0.06, 0.1]}
  m4 = dict(m8, microbatches=4)  # No target at M=4: not reported.
  # Round 1: the twins at once take 0.11 s a step against 0.1 alone, so
  # two cores give 2 * 0.1 / 0.11 = 1.818x one; round 2: 2.0x. M=8 runs
  # 1.667x and 2.0x one worker, 0.9375 and 1.125 of its ideal 1.778, so
  # 1.031 and 1.125 of the best K=2 can reach on those cores.
  ceiling = pipeline_bench.two_cores([one_worker, m8, m4],
                                     [[0.11, 0.11], [0.19, 0.21]])
  assert ceiling.keys() == {"throughput", "M=8"}
  assert ceiling["throughput"] == pytest.approx([20 / 11, 2.0])
  assert ceiling["M=8"] == pytest.approx([0.9375 * 1.1, 1.125])
  assert pipeline_bench.ceiling_lines(ceiling) == [
      "- two cores against one (two one-worker processes at once, each "
      "pinned to a core): 1.909 (rounds 1.818-2.000)x the throughput; K=2's "
      "best share of the ideal is half that",
      "- 1f1b deep_mlp K=2 M=8: share of that best: 1.078 (rounds "
      "1.031-1.125)"]
  # On one core, or without the one worker's row: not measured, said so.
  assert pipeline_bench.two_cores([m8], [[0.1, 0.1]]) == {}
  assert pipeline_bench.ceiling_lines({}) == [
      "- two cores against one: not measured (fewer than 2 cores)"]


def test_pipeline_microbatch_cost_is_per_round():
  from tools.benchmarks import pipeline_bench  # pylint: disable=g-import-not-at-top
  one_worker = {"schedule": "sync, one worker", "model": "deep_mlp",
                "stages": 1, "microbatches": 1, "step_s_rounds": [0.1, 0.2]}
  accumulated = {"schedule": pipeline_bench.ACCUMULATED, "model": "deep_mlp",
                 "stages": 1, "microbatches": 16,
                 "step_s_rounds": [0.15, 0.24], "step_s_measured": 0.195}
  # The timed steps' actions: stage 1 is the slower, 1.6 + 3.4 = 5 ms a
  # micro-batch, against the one worker's (median) 0.195 s / 16 / 2 =
  # 6.094 ms: 0.821x; 17 of them are 0.085 s, 0.817 of the step's 0.104 s.
  m16 = {"schedule": "1f1b", "model": "deep_mlp", "stages": 2,
         "microbatches": 16, "ideal_speedup": 32 / 17,
         "step_s_rounds": [0.08, 0.128], "step_s_measured": 0.104,
         "durations": {"0": {"F": 0.0015, "B": 0.003},
                       "1": {"F": 0.0016, "B": 0.0034}}}
  # No 1F1B row at M=8: its cost alone.
  m8_alone = dict(accumulated, microbatches=8, step_s_rounds=[0.11, 0.22])
  # Round 1: 16 micro-batches take 1.5x the whole batch's step, and 1F1B
  # runs 0.1/0.08 = 1.25x one worker, 0.664 of the ideal 1.882; against
  # the one worker's 16 micro-batches (0.15/0.08 = 1.875x) it is 0.996.
  # Round 2: 1.2x; 1F1B 1.5625x one worker, 0.830 of the ideal; 0.996.
  # The accumulated rows come first: the reference is picked by name.
  cost = pipeline_bench.microbatch_cost([accumulated, m8_alone, one_worker,
                                         m16])
  assert cost.keys() == {8, 16}
  assert cost[16]["cost"] == pytest.approx([1.5, 1.2])
  assert cost[16]["shares"] == pytest.approx(
      [0.15 / 0.08 / (32 / 17), 0.24 / 0.128 / (32 / 17)])
  assert cost[16]["action_s"] == pytest.approx(0.005)
  assert cost[16]["actions"] == pytest.approx(0.005 / (0.195 / 32))
  assert cost[16]["schedule"] == pytest.approx(17 * 0.005 / 0.104)
  assert cost[8] == {"cost": pytest.approx([1.1, 1.1])}
  assert pipeline_bench.microbatch_lines(cost) == [
      "- one worker with the batch as M=8 micro-batches: 1.100 (rounds "
      "1.100-1.100)x its step whole",
      "- one worker with the batch as M=16 micro-batches: 1.350 (rounds "
      "1.200-1.500)x its step whole",
      "- 1f1b deep_mlp K=2 M=16 against that one worker: share of the ideal "
      "speed-up: 0.996 (rounds 0.996-0.996)",
      "- 1f1b deep_mlp K=2 M=16: a micro-batch's actions on its slower stage "
      "5.00 ms, 0.821x that one worker's micro-batch over the 2 stages; "
      "(M+K-1) of them are 0.817 of its step"]
  # Without the timed steps' actions, the shares alone.
  no_actions = {k: v for k, v in m16.items() if k != "durations"}
  assert pipeline_bench.microbatch_cost([accumulated, one_worker,
                                         no_actions])[16].keys() == {
                                             "cost", "shares"}
  # Without the one worker's row: not measured, said so.
  assert pipeline_bench.microbatch_cost([accumulated, m16]) == {}
  assert pipeline_bench.microbatch_lines({}) == [
      "- one worker with the batch as micro-batches: not measured"]


def test_pipeline_accumulated_rows_are_not_the_reference():
  from tools.benchmarks import pipeline_bench  # pylint: disable=g-import-not-at-top
  one_worker_process = pipeline_bench._workers(False)[0]  # pylint: disable=protected-access
  variants = one_worker_process["variants"]
  # The first variant is the reference (and the pinned twins' copy).
  assert "accum" not in variants[0] and variants[0]["model"] == "deep_mlp"
  assert sorted(v["accum"] for v in variants if "accum" in v) == sorted(
      pipeline_bench.SHARE_TARGETS)
  assert not any("accum" in v for w in pipeline_bench._workers(True)  # pylint: disable=protected-access
                 for v in w["variants"])
  runs = [{"s": 0.3, "mb": 1.0, "bubble": None}]
  rows = [pipeline_bench._row(one_worker_process, v, runs, False)  # pylint: disable=protected-access
          for v in variants]
  assert [r["schedule"] for r in rows if r["model"] == "deep_mlp"] == [
      "sync, one worker"] + [pipeline_bench.ACCUMULATED] * len(
          pipeline_bench.SHARE_TARGETS)
  assert [r["microbatches"] for r in rows
          if r["schedule"] == pipeline_bench.ACCUMULATED] == list(
              pipeline_bench.SHARE_TARGETS)


def test_pieces_compute_the_whole_batchs_products():
  from tools.benchmarks import pieces  # pylint: disable=g-import-not-at-top
  # Cut into 2 or 4 pieces, each product sums to what the whole batch's
  # gives (the weight gradient's first element, alone or summed, is the sum
  # of the pieces' first elements): the pieces do the same work, not less.
  fns = pieces._variants(rows=64, width=32, pieces=(2, 4))  # pylint: disable=protected-access
  assert sorted(fns) == sorted((p, m) for p in pieces.PRODUCTS
                               for m in (1, 2, 4))
  for product in pieces.PRODUCTS:
    whole = float(fns[(product, 1)]())
    assert whole != 0.0
    for m in (2, 4):
      assert float(fns[(product, m)]()) == pytest.approx(whole, rel=1e-4)


def test_pieces_run_in_a_bounded_child_on_one_core(monkeypatch):
  from tools.benchmarks import pieces  # pylint: disable=g-import-not-at-top
  core = sorted(os.sched_getaffinity(0))[-1]
  out = pieces.measure(quick=True, core=core)
  rows, width, counts, rounds, _ = pieces.SIZES[True]
  assert (out["rows"], out["width"]) == (rows, width)
  assert sorted(out["pieces"]) == list(counts)
  for ratios in out["pieces"].values():
    assert sorted(ratios) == sorted(pieces.PRODUCTS)
    assert all(len(r) == rounds and all(_positive(x) for x in r)
               for r in ratios.values())
  # A child that outlives its bound is killed, and the suite says why
  # instead of failing.
  # Quick sizes check the harness; their numbers are not printed.
  assert pieces.lines(out) == [
      "- a Dense layer's products in pieces: not measured (--quick's sizes "
      "only check the harness)"]
  # A core it may not run on: the child says so, and so does the line.
  (line,) = pieces.lines(pieces.measure_or_why(quick=True, core=99999))
  assert line.startswith("- a Dense layer's products in pieces: not "
                         "measured (the products benchmark failed (exit 1): "
                         "pieces: cannot run on core 99999")
  monkeypatch.setattr(pieces, "TIMEOUT_S", 0.01)
  with pytest.raises(RuntimeError, match="took over 0.01 s"):
    pieces.measure(quick=True)
  (line,) = pieces.lines(pieces.measure_or_why(quick=True))
  assert line.startswith("- a Dense layer's products in pieces: not "
                         "measured (the products benchmark took over")


def test_pieces_lines_give_each_products_median_and_spread():
  from tools.benchmarks import pieces  # pylint: disable=g-import-not-at-top
  result = {"rows": 1024, "width": 512, "quick": False, "pieces": {16: {
      "forward": [1.0, 0.9, 1.1], "input gradient": [1.2, 1.3, 1.25],
      "weight gradient": [1.1, 1.1, 1.1],
      "weight gradient summed": [1.2, 1.3, 1.1]}}}
  assert pieces.lines(result) == [
      "- a Dense layer's products (512x512 weights, one thread) on 16 "
      "pieces of 64 rows against 1024 rows whole: forward 1.000x (rounds "
      "0.900-1.100), input gradient 1.250x (rounds 1.200-1.300), weight "
      "gradient 1.100x (rounds 1.100-1.100), weight gradient summed 1.200x "
      "(rounds 1.100-1.300)"]
