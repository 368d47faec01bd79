"""Pipeline v2: the I/W split, the new schedules, timing, determinism, auto.

Every schedule must equal single-device sync after several Adam steps; a
covering set of K = 2 and 3 (4 is test_transformer_modes.py's), recompute
settings, V = 2 where it applies and R x K hybrid is run. The split of the
backward into I and W must do no FLOP twice: that is checked on the ops
that run, not on timings. Timing must add its ops only to the steps that
are logged, and --deterministic must run.
"""

import collections
import logging
import math
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config  # pylint: disable=g-direct-tensorflow-import

from conftest import max_diff
from helpers import load_data, record_host_timing
from dist_loop import configure, make_config, models, tasks
from dist_loop.core.errors import UserError
from dist_loop.models import MODELS
from dist_loop.parallel.modes import build_trainer, xla
from dist_loop.parallel.modes.pipeline import PipelineTrainer, costs, planner
from dist_loop.parallel.modes.pipeline import timing
from dist_loop.parallel.modes.pipeline.chunk import Chunk
from dist_loop.runtime import devices
from dist_loop.runtime.cluster import Cluster

STEPS = 3
TOLERANCE = 1e-5
LOCAL = Cluster()
MODEL = "test_five_layers"


@MODELS.register(MODEL)
def _five_layers(input_shape, num_classes):
  """Enough layers for the 4 chunks of K=2 interleaved 1F1B and ZB-V (a
  step's trace grows with its layers); one layer with a weight and an
  activity regulariser, whose terms travel between chunks."""
  del input_shape
  l2 = keras.regularizers.L2
  return ([keras.layers.Dense(12, activation="relu", name="dense_0"),
           keras.layers.Dense(12, activation="tanh", name="dense_1",
                              kernel_regularizer=l2(0.02),
                              activity_regularizer=l2(0.01))]
          + [keras.layers.Dense(12, activation="relu", name=f"dense_{i}")
             for i in range(2, 4)]
          + [keras.layers.Dense(num_classes, name="logits")])


# Pipelines plan from eagerly timed layer costs (conftest.py).
pytestmark = pytest.mark.usefixtures("eager_costs")


def config(tmp_path, **overrides):
  # --jit_compile as decided on CPU: the planner takes a decided value.
  flat = dict(workdir=str(tmp_path), dataset="synthetic", model=MODEL,
              num_devices=1, global_batch_size=48, train_steps=STEPS,
              optimizer="adam", learning_rate=0.01, steps_per_loop=STEPS,
              log_every=STEPS, eval_every=STEPS, checkpoint_every=STEPS,
              seed=0, jit_compile=False)
  flat.update(overrides)
  return configure.validate(make_config(**flat), LOCAL)


def build(cfg):
  names = devices.configure(cfg.num_devices, "cpu")
  keras.utils.set_random_seed(cfg.seed)
  return build_trainer(cfg, names, load_data(cfg), LOCAL)


def weights(trainer):
  return [v.numpy() for v in trainer.model.trainable_variables]


def pipeline(schedule, k, m, replicas=1, recompute="never", **overrides):
  return dict(mode="pipeline", num_devices=replicas * k, num_stages=k,
              num_microbatches=m, pipeline_schedule=schedule,
              recompute=recompute, stage_split="params",
              pipeline_timing="never", **overrides)


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory):
  trainer = build(config(tmp_path_factory.mktemp("sync")))
  start = weights(trainer)
  trainer.train(STEPS)
  out = weights(trainer)
  trainer.close()
  assert max_diff(out, start) > 1e-2  # Training moved the variables.
  return out


# -- every schedule equals sync --

# A covering set, not the full product: each new schedule at least once,
# K = 2 (interleaved, and R=2 x K=2 hybrid) and 3, and each recompute
# setting with a schedule that splits B into I and W (interleaved 1F1B,
# which does not, runs without recompute). ZB-V (K=2, M=4, recomputing all
# but the last chunk) is in the --deterministic test below; GPipe at K=2
# and 1F1B at K=2 and 3 (and in hybrid) in test_pipeline.py; 1F1B at K=4
# in test_transformer_modes.py; eager 1F1B at K=2 in test_extensions.py.
# M = K (a trace grows with M); M > K is the ZB-V case and
# test_pipeline.py's.
@pytest.mark.parametrize("schedule,k,m,replicas,recompute", [
    ("interleaved_1f1b", 2, 2, 1, "never"),
    ("zb_h1", 2, 2, 2, "always"),
    ("zb_h1", 3, 3, 1, "except_last"),
])
def test_every_schedule_equals_single_device_sync(
    tmp_path, sync_reference, schedule, k, m, replicas, recompute):
  trainer = build(config(tmp_path, **pipeline(schedule, k, m, replicas,
                                              recompute)))
  chunks = {"interleaved_1f1b": 2 * k, "zbv": 2 * k}.get(schedule, k)
  assert trainer.schedule.num_chunks == len(trainer.chunk_spans) == chunks
  metrics = trainer.train(STEPS)
  assert metrics["train/skipped_steps"] == 0
  assert max_diff(sync_reference, weights(trainer)) <= TOLERANCE
  trainer.close()


# -- I + W is B: no FLOP twice --

EXPENSIVE = ("MatMul", "BatchMatMulV2", "Einsum", "Conv2D",
             "Conv2DBackpropInput", "Conv2DBackpropFilter",
             "UnsortedSegmentSum")


def _live(concrete):
  """Every op that runs: what the function's outputs and side effects need
  (the rest is pruned when it is instantiated)."""
  graph = concrete.graph
  stack = [t.op for t in concrete.outputs] + list(graph.control_outputs)
  seen = set()
  while stack:
    op = stack.pop()
    if op.name not in seen:
      seen.add(op.name)
      stack += [t.op for t in op.inputs] + list(op.control_inputs)
  return [op for op in graph.get_operations() if op.name in seen]


def _live_ops(concrete) -> collections.Counter:
  """(action scope, op type) of every op that runs."""
  return collections.Counter((op.name.split("/")[0], op.type)
                             for op in _live(concrete))


def _split_against_whole(layers, x, grads_out, reg_in=None, first=False,
                         head=None):
  """Runs F then B, and F then I then W, of one chunk; returns both results
  and the ops that run in each action."""
  chunk = Chunk(layers, first=first, recompute=False, head=head)
  args = (x,) if reg_in is None else (x, reg_in)

  @tf.function(autograph=False)
  def whole(x, reg_in=None):
    with tf.name_scope("F"):
      record = chunk.forward(x, reg_in)
    with tf.name_scope("B"):
      return chunk.backward(record, grads_out)

  @tf.function(autograph=False)
  def split(x, reg_in=None):
    with tf.name_scope("F"):
      record = chunk.forward(x, reg_in)
    with tf.name_scope("I"):
      sent, kept = chunk.input_grad(record, grads_out)
    with tf.name_scope("W"):
      return sent, chunk.weight_grad(kept)

  results = [f(*args) for f in (whole, split)]
  ops = [_live_ops(f.get_concrete_function(*args)) for f in (whole, split)]
  return results, ops


def _by_type(ops, scope):
  return collections.Counter({t: n for (s, t), n in ops.items()
                              if s == scope and t in EXPENSIVE})


def test_input_and_weight_gradients_split_b_without_repeating_a_flop():
  keras.utils.set_random_seed(0)
  layers = _five_layers(None, 4)[:4]
  model = keras.Sequential(layers)
  model.build((None, 6))
  x = tf.random.normal([5, 6])
  reg_in = tf.constant(0.5)
  grads_out = [tf.random.normal([5, 12]), tf.constant(0.25)]
  (whole, split), (ops_b, ops_iw) = _split_against_whole(
      layers, x, grads_out, reg_in=reg_in)
  for a, b in zip(tf.nest.flatten(whole), tf.nest.flatten(split)):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
  b, i, w = (_by_type(ops_b, "B"), _by_type(ops_iw, "I"),
             _by_type(ops_iw, "W"))
  # Four layers: a matmul each for the input gradients (I) and the kernel
  # gradients (W), and B is exactly the two.
  assert i == {"MatMul": 4} and w == {"MatMul": 4} and b == i + w
  # W never goes back through the data path: no activation derivative.
  assert not any(t in ("ReluGrad", "TanhGrad") for s, t in ops_iw
                 if s == "W")


def test_the_split_holds_for_a_transformer_chunk():
  keras.utils.set_random_seed(0)
  options = MODELS.get("transformer").Options(
      num_layers=1, d_model=8, num_heads=2, mlp_ratio=2)
  model = models.build("transformer", (6,), 16, options=options)
  ids = tf.random.uniform([3, 6], maxval=16, dtype=tf.int32)
  probe = tf.random.normal([3, 6, 16])

  def head(out, reg):
    del reg
    return tf.reduce_sum(out * probe), None

  (whole, split), (ops_b, ops_iw) = _split_against_whole(
      model.layers, ids, None, first=True, head=head)
  for a, b in zip(tf.nest.flatten(whole), tf.nest.flatten(split)):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
  b, i, w = (_by_type(ops_b, "B"), _by_type(ops_iw, "I"),
             _by_type(ops_iw, "W"))
  assert sum(w.values()) > 0 and sum(i.values()) > 0
  assert b == i + w
  assert w["UnsortedSegmentSum"] == 1  # The embedding's gradient, in W.


# -- timing: only a call's last step carries timestamps --

def _op_types(trainer, variant, batch):
  """Every op type of one traced step of `variant`, its nested functions
  included; a call of the timestamp function counts as "stamp"."""
  step = tf.function(
      lambda x, y: vars(trainer.replica_step((x, y), variant)),
      autograph=False)
  graph_def = step.get_concrete_function(*batch).graph.as_graph_def()
  nodes = list(graph_def.node)
  for function in graph_def.library.function:
    nodes += list(function.node_def)
  return collections.Counter(
      "stamp" if "stamp_into" in n.attr["f"].func.name else n.op
      for n in nodes)


def test_log_timing_times_only_the_last_step_of_a_call(tmp_path):
  # The 3-layer mlp: this test traces the step four times. The controller
  # ends a call where an action runs, so the step a log line follows is the
  # last of its call; the mode needs no schedule of its own.
  cfg = config(tmp_path, train_steps=6, log_every=3, model="mlp",
               **dict(pipeline("zb_h1", 2, 2), pipeline_timing="log"))
  trainer = build(cfg)
  assert trainer.loop_begin(0, 1) == [(1, "timed")]
  assert trainer.loop_begin(3, 3) == [(2, "untimed"), (1, "timed")]
  assert trainer.timeline_bars() is None
  assert "pipeline/bubble_measured" not in trainer.report().scalars
  metrics = trainer.train(4)  # Steps 0..2 untimed, then step 3: timed.
  assert trainer.trace_counts == {"untimed": 1, "timed": 1}
  # The timed step's bubble and span go to the report, not the metrics.
  assert not any("bubble" in k or "span" in k for k in metrics)
  assert 0 <= trainer.report().scalars["pipeline/bubble_measured"] < 1
  # The measured timeline has every action of the schedule, in each
  # device's order, one after the other.
  bars = trainer.timeline_bars()
  for d, row in enumerate(trainer.schedule.devices):
    mine = [(a, s, e) for dev, a, s, e in bars if dev == d]
    assert [a for a, _, _ in mine] == list(row)
    assert all(s <= e for _, s, e in mine)
    assert all(e <= s for (_, _, e), (_, s, _) in zip(mine, mine[1:]))
  batch = (tf.constant(trainer.dataset.train_x[:48]),
           tf.constant(trainer.dataset.train_y[:48]))
  untimed = _op_types(trainer, "untimed", batch)
  timed = _op_types(trainer, "timed", batch)
  actions = sum(len(row) for row in trainer.schedule.devices)
  assert untimed["Timestamp"] == untimed["stamp"] == 0
  assert timed["Timestamp"] == 1 and timed["stamp"] == 2 * actions
  assert sum(untimed.values()) < sum(timed.values())
  # Why --deterministic runs untimed (the next test): the timed step is
  # refused under op determinism.
  tf_config.enable_op_determinism()
  try:
    with pytest.raises(tf.errors.OpError, match="determinism"):
      trainer.train(2)  # Its last step is timed.
  finally:
    tf_config.disable_op_determinism()
  trainer.close()


@pytest.fixture
def op_determinism():
  tf_config.enable_op_determinism()
  try:
    yield
  finally:
    tf_config.disable_op_determinism()


def test_deterministic_runs_untimed_and_says_so(tmp_path, op_determinism,
                                                 caplog, sync_reference):
  del op_determinism
  with caplog.at_level(logging.INFO, logger="absl"):
    trainer = build(config(tmp_path, deterministic=True, **dict(
        pipeline("zbv", 2, 4, recompute="except_last"),
        pipeline_timing="log")))
  assert trainer.schedule.num_chunks == len(trainer.chunk_spans) == 4
  assert trainer.timing == "never"
  said = [r.getMessage() for r in caplog.records
          if "--deterministic" in r.getMessage()]
  assert len(said) == 1 and "timing is off" in said[0]
  trainer.train(STEPS)  # Ends at a log line.
  assert max_diff(sync_reference, weights(trainer)) <= TOLERANCE
  report = trainer.report()
  assert "pipeline/bubble_measured" not in report.scalars
  assert "pipeline/timeline" in report.images  # The predicted one.
  trainer.close()
  # Why: a timed step is refused under op determinism (the test above).


# -- planning: before the placed build --

def test_plan_cuts_the_probe_the_run_starts_from(tmp_path):
  cfg = config(tmp_path, **pipeline("zbv", 2, 4))
  names = devices.configure(cfg.num_devices, "cpu")
  dataset = load_data(cfg)
  # As the trainer plans: with --jit_compile=auto decided (off on CPU).
  cfg = xla.resolve(cfg, names, dataset, LOCAL)[0]
  keras.utils.set_random_seed(cfg.seed)
  plan = planner.plan(cfg, dataset, names, traced=False)
  keras.utils.set_random_seed(cfg.seed)
  fresh = models.build_for(cfg, dataset)  # What sync starts from.
  assert max_diff(plan.initial_weights, fresh.get_weights()) == 0
  chosen = plan.chosen
  assert plan.candidates == (chosen,) and chosen.name == "zbv"
  assert plan.skipped == ()
  assert chosen.schedule.placement == (0, 1, 1, 0)
  # Four chunks (the V of ZB-V) of consecutive layers, all of them.
  assert [s.index for s in chosen.spans] == [0, 1, 2, 3]
  assert [s.start for s in chosen.spans] == [0] + [
      s.end for s in chosen.spans[:-1]]
  assert chosen.spans[-1].end == len(fresh.layers)
  assert chosen.split_how == "params"


# -- auto: the fastest predicted schedule within the memory budget --

def test_auto_picks_the_fastest_predicted_schedule_that_fits(
    tmp_path, caplog, monkeypatch):
  monkeypatch.setattr(PipelineTrainer, "cost_measurement", "traced")
  with caplog.at_level(logging.INFO, logger="absl"):
    # One core per op, two at once: the two devices each get a core.
    trainer = build(config(tmp_path, intra_op_threads=1, inter_op_threads=2,
                           **pipeline("auto", 2, 4)))
  table = [r.getMessage() for r in caplog.records
           if "predicted from the measured costs" in r.getMessage()]
  assert len(table) == 1
  for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"):
    assert f" {name} " in table[0]
  chosen = trainer.plan.chosen.prediction
  assert trainer.summary()["pipeline_schedule"] == trainer.schedule_name
  assert f"* {trainer.schedule_name} " in table[0]
  # No other candidate is predicted faster.
  plans = trainer.plan.candidates
  assert {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"} <= {
      p.name for p in plans}
  assert chosen.step_time == min(p.prediction.step_time for p in plans)
  # Each candidate's chunks were measured as chunks, alone and crowded (on
  # both logical CPU devices at once: they share the cores).
  cores = min(2.0, len(os.sched_getaffinity(0)))
  for p in plans:
    assert p.costs.cores == cores
    assert all(b > 0 for b in p.costs.backward)
    # Crowded times exist where two actions can run at once.
    assert len(p.costs.crowded) == (p.schedule.num_chunks if cores >= 2
                                    else 0)
    assert all(t > 0 for row in p.costs.crowded for t in row)
  # A budget below the fastest one's memory but above 1F1B's excludes it.
  by_name = {p.name: p for p in plans}
  budget = by_name["1f1b"].prediction.peak_mb
  fits = planner.pick(plans, budget)
  assert fits.prediction.peak_mb <= budget
  assert fits.prediction.step_time == min(
      p.prediction.step_time for p in plans
      if p.prediction.peak_mb <= budget)
  with pytest.raises(UserError, match="raise --pipeline_memory_mb"):
    planner.pick(plans, 1e-6)
  trainer.close()


def _dense_chunks():
  """Two chunks of Dense layers (one, then two), built; one micro-batch."""
  keras.utils.set_random_seed(0)
  layers = [keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(4, activation="relu"), keras.layers.Dense(10)]
  keras.Sequential(layers).build((None, 64))
  return ([layers[:1], layers[1:]], tf.random.normal([32, 64]),
          tf.zeros([32], tf.int32))


def test_chunk_timer_times_each_chunks_own_ops_on_every_device():
  chunks, x, y = _dense_chunks()
  task = tasks.TASKS.get("classification")()
  timer = timing.ChunkTimer(chunks, x, y, task, ["/CPU:0", "/CPU:1"])
  # What is timed: micro-batch 0 runs F, then I and W from the last chunk
  # back; micro-batch 1 runs F, then B (timed whole, not as I + W).
  assert [f"{a}c{a.chunk}" for a in timer.row] == [
      "F0c0", "F0c1", "I0c1", "W0c1", "I0c0", "W0c0",
      "F1c0", "F1c1", "B1c1", "B1c0"]
  concrete = timer.step.get_concrete_function(*timer.inputs)
  by_scope = collections.defaultdict(list)
  for op in _live(concrete):
    by_scope[op.name.split("/")[0]].append(op)
  owner = {internal.name: c for external, internal in concrete.graph.captures
           for c, chunk in enumerate(chunks) for layer in chunk
           for v in layer.trainable_variables if external is v.handle}
  for d in (0, 1):  # Crowded: each device runs every action at once.
    for a in timer.row:
      ops = by_scope.pop(f"r{d}_{a.kind}{a.microbatch}_c{a.chunk}")
      # Every op placed is on device d (reads of a variable, left unplaced,
      # go where the variable is).
      assert {tf.DeviceSpec.from_string(op.device).device_index
              for op in ops if op.device} == {d}, (d, a)
      # Its chunk's variables, all of them in F, and no other chunk's.
      read = [owner[op.inputs[0].name] for op in ops
              if op.type == "ReadVariableOp"]
      assert read == ([a.chunk] * 2 * len(chunks[a.chunk])
                      if a.kind == "F" else []), (d, a)
      # Its chunk's layers' matmuls: one per layer in F and in W, one per
      # layer with a gradient to send in I (not the first chunk's), both
      # in B.
      sends = len(chunks[a.chunk]) if a.chunk else 0
      expected = {"F": len(chunks[a.chunk]), "W": len(chunks[a.chunk]),
                  "I": sends, "B": len(chunks[a.chunk]) + sends}[a.kind]
      assert sum(op.type == "MatMul" for op in ops) == expected, (d, a)
  # No other action runs (what is left: the inputs, their split, the sum).
  assert not [s for s in by_scope if re.fullmatch(r"r\d+_[FIWB]\d+_c\d+", s)]
  assert timer.durations().shape == (2, len(timer.row))


def test_host_timer_times_each_chunks_own_actions_without_timestamps(
    op_determinism):
  del op_determinism  # Which refuses timestamps.
  chunks, x, y = _dense_chunks()
  task = tasks.TASKS.get("classification")()
  timer = timing.HostTimer(chunks, x, y, task, ["/CPU:0", "/CPU:1"])
  durations = timer.durations()
  assert durations.shape == (1, len(timer.row))
  assert (durations >= 0).all()
  # Each action is timed as a call of its chunk's actions up to it, against
  # the call before it (no action: the inputs' copies only).
  ups = ((), ("F",), ("F", "I"), ("F", "I", "W"), ("F", "B"))
  assert set(timer.functions) == {(c, a) for c in (0, 1) for a in ups}
  for (c, actions), fn in timer.functions.items():
    concrete, = fn._list_all_concrete_functions()  # pylint: disable=protected-access
    ops = _live(concrete)
    assert not [op for op in ops if op.type == "Timestamp"]
    # Crowded: every action on each device, built as the executor builds
    # it (the matmuls that run, as in the test above).
    sends = len(chunks[c]) if c else 0
    each = {"F": len(chunks[c]), "W": len(chunks[c]), "I": sends,
            "B": len(chunks[c]) + sends}
    for d in (0, 1):
      assert sum(op.type == "MatMul" and tf.DeviceSpec.from_string(
          op.device).device_index == d for op in ops) == sum(
              each[a] for a in actions), (c, actions, d)


def test_the_deterministic_planner_times_the_runs_chunks_from_the_host(
    tmp_path, op_determinism, monkeypatch):
  # Under --deterministic the layers, then the chosen cut's chunks alone
  # and crowded, are timed as the executor runs them, from the host; no
  # layer is timed eagerly (measure_layers gives the sizes only).
  del op_determinism
  timers, eager = record_host_timing(monkeypatch)
  cfg = config(tmp_path, deterministic=True, intra_op_threads=1,
               inter_op_threads=2, **pipeline("1f1b", 2, 4))
  keras.utils.set_random_seed(cfg.seed)
  plan = planner.plan(cfg, load_data(cfg),
                      devices.configure(cfg.num_devices, "cpu"))
  assert eager == [0]
  cores = min(2, len(os.sched_getaffinity(0)))
  timed = {id(t): t for t in timers}.values()
  bounds = [s.start for s in plan.chosen.spans] + [plan.chosen.spans[-1].end]
  layers = bounds[-1]
  # One layer per chunk on one device; the chosen chunks alone; crowded.
  assert sorted((len(t.executor.chunks), len(t.devices)) for t in timed) == (
      sorted([(layers, 1), (2, 1)] + ([(2, 2)] if cores >= 2 else [])))
  for t in timed:
    if len(t.executor.chunks) == 2:
      assert [len(c.layers) for c in t.executor.chunks] == [
          b - a for a, b in zip(bounds, bounds[1:])]
  assert len(plan.chosen.costs.crowded) == (2 if cores >= 2 else 0)


def test_a_deterministic_plan_from_timings_names_the_flags_that_pin_it(
    tmp_path, caplog):
  names = devices.configure(2, "cpu")
  flags = dict(pipeline("auto", 2, 4), stage_split="auto",
               deterministic=True)
  cfg = config(tmp_path, **flags)
  dataset = load_data(cfg)
  with caplog.at_level(logging.WARNING, logger="absl"):
    plan = planner.plan(cfg, dataset, names, traced=False)
  said = [r.getMessage() for r in caplog.records
          if "--deterministic" in r.getMessage()]
  assert len(said) == 1
  pin = dict(re.findall(r"--(\w+)=(\S+)", said[0].split("pass ")[1]))
  cut = [(s.start, s.end) for s in plan.chosen.spans]
  assert pin == {"pipeline_schedule": plan.chosen.name,
                 "stage_split": "explicit",
                 "split_points": ",".join(str(a) for a, _ in cut[1:])}
  # The flags give the same plan, chosen from no timing: no warning.
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="absl"):
    pinned = planner.plan(config(tmp_path, **dict(flags, **pin)), dataset,
                          names, traced=False)
  assert pinned.chosen.name == plan.chosen.name
  assert [(s.start, s.end) for s in pinned.chosen.spans] == cut
  assert not [r for r in caplog.records if "--deterministic" in
              r.getMessage()]


def test_chunk_seconds_take_each_action_from_its_column():
  row = timing.timing_row(2)
  # Action j's durations are 10 (j + 1) plus 0..5 over 3 runs x 2 devices.
  durations = (10.0 * np.arange(1, 11)
               + np.arange(6.0).reshape(3, 2, 1))
  assert timing.chunk_seconds(row, durations) == [
      (12.5, 52.5, 62.5, 102.5), (22.5, 32.5, 42.5, 92.5)]
  # Without B (only micro-batch 0), B is taken as I + W.
  row = timing.timing_row(2, backward=False)
  durations = 10.0 * np.arange(1, 7)[None, None]
  assert timing.chunk_seconds(row, durations) == [
      (10.0, 50.0, 60.0, 110.0), (20.0, 30.0, 40.0, 70.0)]
  # Compiled: micro-batch 0's F, then B, whole; I is B and W nothing.
  row = timing.timing_row(2, jit_compile=True)
  assert [f"{a}c{a.chunk}" for a in row] == ["F0c0", "F0c1", "B0c1", "B0c0"]
  durations = 10.0 * np.arange(1, 5)[None, None]
  assert timing.chunk_seconds(row, durations) == [
      (10.0, 40.0, 0.0, 40.0), (20.0, 30.0, 0.0, 30.0)]


def test_layer_costs_and_the_costs_of_chunks_from_them():
  (first, rest), x, y = _dense_chunks()
  layers = first + rest
  sizes = costs.measure_layers(layers, (64,), 32, repeats=0)
  assert [c.output_bytes for c in sizes] == [32 * 256 * 4, 32 * 4 * 4,
                                            32 * 10 * 4]
  assert [c.input_bytes for c in sizes] == [32 * 64 * 4, 32 * 256 * 4,
                                           32 * 4 * 4]
  assert all(c.forward == 0 for c in sizes)  # Sizes only.
  task = tasks.TASKS.get("classification")()
  measured = costs.measure_traced(layers, sizes, x, y, task, "/CPU:0")
  for c, size in zip(measured, sizes):
    assert c.backward == c.input_grad + c.weight_grad  # Balance only.
    assert (c.input_bytes, c.output_bytes) == (size.input_bytes,
                                               size.output_bytes)
  chunks = costs.for_chunks(measured, [0, 1, 3], recompute="except_last")
  assert chunks.forward[1] == pytest.approx(measured[1].forward
                                            + measured[2].forward)
  # The first chunk recomputes its forward in its backward; the last not.
  assert chunks.input_grad[0] == pytest.approx(measured[0].input_grad
                                               + measured[0].forward)
  assert chunks.input_grad[1] == pytest.approx(measured[1].input_grad
                                               + measured[2].input_grad)
  assert chunks.recomputes == (True, False)
  assert chunks.activation_bytes == (
      sizes[0].input_bytes + sizes[0].output_bytes,
      sum(s.input_bytes + s.output_bytes for s in sizes[1:]))


def test_shared_cores_of_logical_cpus_and_of_gpus(monkeypatch):
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3},
                      raising=False)
  cpus = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (0, 1)]
  # Actions that run at once without sharing a core.
  assert costs.shared_cores(cpus, 1, 0) == 4.0
  assert costs.shared_cores(cpus, 1, 2) == 2.0  # 2 ops at once.
  assert costs.shared_cores(cpus, 0, 0) == 1.0  # All cores per op.
  assert costs.shared_cores(cpus, 2, 0) == 2.0
  assert costs.shared_cores(cpus, 1, 8, replicas=2) == 2.0
  assert costs.shared_cores(["/device:GPU:0", "/device:GPU:1"], 1, 2) == (
      math.inf)


@pytest.mark.parametrize("overrides,message", [
    (dict(pipeline_schedule="interleaved_1f1b", num_stages=2,
          num_microbatches=3, global_batch_size=48),
     r"--num_microbatches=3 must be a multiple of 2"),
    (dict(pipeline_schedule="zbv", virtual_stages=3), r"zbv puts 2 chunks"),
    (dict(pipeline_schedule="1f1b", virtual_stages=2),
     r"one chunk of layers on each device"),
    (dict(pipeline_schedule="zbv", model="mlp"),
     r"needs 4 chunks of layers but model 'mlp' has 3"),
    (dict(pipeline_schedule="zbv", stage_split="explicit", split_points="3"),
     r"gives 2 chunks but --pipeline_schedule=zbv \(2 devices x 2 chunks\) "
     r"needs 4"),
    (dict(pipeline_memory_mb=10.0), r"only read with --pipeline_schedule=auto"),
    (dict(pipeline_timing="sometimes"), r"unknown --pipeline_timing"),
])
def test_bad_schedule_options_fail_at_the_door(tmp_path, overrides, message):
  flat = {"mode": "pipeline", "num_devices": 2, "num_stages": 2,
          **overrides}
  with pytest.raises(UserError, match=message):
    config(tmp_path, **flat)


def test_counting_a_models_layers_does_not_start_tensorflow():
  """The pipeline's rules count the model's layers as the flags are
  checked, before the run configures its devices: a layer that makes a
  variable as it is constructed (Dropout's seed state) must not start
  TensorFlow's runtime then, or configuring the devices fails."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = (
      "from dist_loop import make_config\n"
      "from dist_loop.parallel.modes.pipeline import validation\n"
      "config = make_config(mode='pipeline', model='transformer',\n"
      "                     dataset='pysource', dropout=0.1,\n"
      "                     workdir='unused')\n"
      "assert validation.count_layers(config) == 4 + 3\n"
      "from dist_loop.runtime import devices\n"
      "print(len(devices.configure(2, 'cpu')))\n")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run([sys.executable, "-c", code], cwd=repo,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.strip().splitlines()[-1] == "2"
