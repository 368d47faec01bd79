"""Parameter-server mode.

In-process: the locked update (decision, write order, float16 rule), the
stats vector, the atomic counter, the bounded wait and the mode's rules.
Across processes (tools.launch): one run trains on TFRecord shards of the
digits, with a bad record skipped, every push clipped on its worker
(`--clip_global_norm`) and a worker killed mid-run, and a rerun on a new
cluster resumes it on ArrayRecord shards until its PS is killed.
"""

import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import time
import types

import numpy as np
import pytest
import tensorflow as tf

from conftest import read_events
from helpers import load_data
from dist_loop import configure, data
from dist_loop.control import weights
from dist_loop.control.evaluation import Evaluator
from dist_loop.core.errors import UserError
from dist_loop.data import shard_format, shard_writer
from dist_loop.parallel import staleness
from dist_loop.parallel.modes.ps import counter, server, stats, trainer, update
from dist_loop.parallel.modes.ps import PSTrainer
from dist_loop.runtime.cluster import Cluster, ClusterError
from dist_loop.runtime.summaries import LOGDIR
from dist_loop.training import optim
from dist_loop.training.precision import DynamicLossScale
from tools import launch

PS_CLUSTER = Cluster({"chief": ["c:1"], "worker": ["a:1", "b:1"],
                      "ps": ["p:1"]}, "chief", 0)
LAYOUT = stats.Layout(("loss", "accuracy"))

# -- the locked update, on local variables --


def _local_update(variable, step, loss_scale=None, max_staleness=0):
  """A LockedUpdate of one variable, and a caller of its traced step."""
  opt = optim.make("sgd", 1.0, [variable])
  vector = tf.Variable(tf.zeros([LAYOUT.size], tf.float64))
  locked = update.LockedUpdate(
      optimizer=opt, variables=[variable], step=step, stats=vector,
      layout=LAYOUT, max_staleness=max_staleness, loss_scale=loss_scale)
  fn = tf.function(lambda g, read, target, loss, scale: locked(
      [g], read, target, {"loss": loss, "accuracy": tf.constant(0.5),
                          "grad_norm": tf.linalg.global_norm([g])}, scale),
                   autograph=False)

  def call(grad, read, target=100, loss=1.0, scale=1.0):
    out = fn(tf.constant(grad, tf.float32), tf.constant(read, tf.int64),
             tf.constant(target, tf.int64), tf.constant(loss, tf.float32),
             tf.constant(scale, tf.float32))
    return {k: x.numpy() for k, x in out.items()}

  return locked, fn, call


def test_the_locked_update_decides_applies_and_records():
  v = tf.Variable([1.0, 2.0])
  step = tf.Variable(5, dtype=tf.int64)
  locked, _, call = _local_update(v, step)
  g = [1.0, 1.0]
  out = call(g, 4)  # One update since the read: too stale for a bound of 0.
  assert (out["dropped"] and not out["applied"] and out["tau"] == 1
          and step.numpy() == 5 and v.numpy().tolist() == [1.0, 2.0])
  out = call(g, 5)  # Fresh: applied, and counted once.
  assert out["applied"] and out["tau"] == 0 and out["step"] == 6
  assert v.numpy().tolist() == [0.0, 1.0]
  assert int(locked.optimizer.iterations.numpy()) == 1
  out = call(g, 6, target=6)  # Fresh, but this call's budget is spent.
  assert not (out["applied"] or out["dropped"]) and step.numpy() == 6
  out = call([np.inf, 1.0], 6)  # No loss scaling: a real non-finite step.
  assert out["nonfinite"] and not (out["skipped"] or out["applied"])
  # Each outcome was recorded under the lock; the staleness histogram and
  # the sums hold the applied update only.
  record = LAYOUT.read(locked.stats.numpy())
  assert record.counts == {"applied": 1, "dropped": 1, "skipped": 0,
                           "nonfinite": 1}
  assert record.staleness.counts[0] == 1 and record.staleness.total == 1
  assert record.means() == pytest.approx(
      {"loss": 1.0, "accuracy": 0.5, "grad_norm": np.sqrt(2.0)})


def test_without_a_bound_any_staleness_is_applied():
  v = tf.Variable([1.0])
  step = tf.Variable(70, dtype=tf.int64)
  locked, _, call = _local_update(v, step, max_staleness=staleness.NO_BOUND)
  out = call([1.0], 0)
  assert out["applied"] and out["tau"] == 70 and not out["dropped"]
  # tau >= MAX_TRACKED lands in the last bin.
  assert LAYOUT.read(locked.stats.numpy()).staleness.max == (
      staleness.MAX_TRACKED)


def _ancestors(op):
  """Every op that `op` waits for, by data or control edges."""
  seen, stack = {}, [op]
  while stack:
    op = stack.pop()
    if op.name not in seen:
      seen[op.name] = op
      stack += [t.op for t in op.inputs] + list(op.control_inputs)
  return list(seen.values())


def test_the_writes_are_ordered_and_done_before_the_lock_is_released():
  v = tf.Variable([1.0, 2.0])
  step = tf.Variable(5, dtype=tf.int64)
  locked, fn, _ = _local_update(v, step)
  spec = tf.TensorSpec([], tf.float32)
  graph = fn.get_concrete_function(
      tf.TensorSpec([2], tf.float32), tf.TensorSpec([], tf.int64),
      tf.TensorSpec([], tf.int64), spec, spec).graph
  release = [op for op in graph.get_operations()
             if op.type == "ConsumeMutexLock"]
  assert len(release) == 1
  before_release = _ancestors(release[0])

  def writes(variable, op_types):
    handle = [internal for external, internal in graph.captures
              if external is variable.handle]
    assert handle, f"{variable.name} is not used in the step"
    return [op for op in before_release if op.type in op_types
            and any(t is handle[0] for t in op.inputs)]

  # 1. The weights (in a cond: only if applied) and the optimizer's
  # counter, 2. the step, 3. the record: all before the release, in order.
  weights = writes(v, ("If", "StatelessIf"))
  iterations = writes(locked.optimizer.iterations.value,
                      ("AssignAddVariableOp",))
  counted = writes(step, ("AssignAddVariableOp",))
  recorded = writes(locked.stats, ("AssignAddVariableOp",))
  assert weights and iterations and counted and recorded
  assert weights[0] in _ancestors(counted[0])
  assert iterations[0] in _ancestors(counted[0])
  assert counted[0] in _ancestors(recorded[0])


def test_fp16_overflow_is_skipped_and_halves_the_scale_once():
  v = tf.Variable([1.0, 2.0])
  step = tf.Variable(5, dtype=tf.int64)
  scale = DynamicLossScale(initial_scale=2.0 ** 10)
  locked, _, call = _local_update(v, step, scale)
  inf = [np.inf, 1.0]
  out = call(inf, 5, scale=2.0 ** 10)  # Overflow at the scale in force.
  assert out["skipped"] and not (out["nonfinite"] or out["applied"])
  assert scale.scale.numpy() == 2.0 ** 9 and step.numpy() == 5
  assert v.numpy().tolist() == [1.0, 2.0]
  assert int(locked.optimizer.iterations.numpy()) == 0
  out = call(inf, 5, scale=2.0 ** 10)  # At the old scale: no second halving.
  assert out["skipped"] and scale.scale.numpy() == 2.0 ** 9
  out = call([1.0, 1.0], 5, scale=2.0 ** 9)  # A good step: applied, counted.
  assert out["applied"] and step.numpy() == 6
  assert int(scale.good_steps.numpy()) == 1
  # The skipped steps' infinite gradient norms are left out of the sums.
  record = LAYOUT.read(locked.stats.numpy())
  assert record.counts["skipped"] == 2 and record.counts["applied"] == 1
  assert record.means()["grad_norm"] == pytest.approx(np.sqrt(2.0))
  out = call(inf, 6, loss=np.nan, scale=2.0 ** 9)  # A NaN loss is real.
  assert out["nonfinite"] and not out["skipped"]
  scale.scale.assign(1.0)
  out = call(inf, 6, scale=1.0)  # At the floor, nothing is left to unscale.
  assert out["nonfinite"] and not out["skipped"] and scale.scale.numpy() == 1


# -- the chief's bookkeeping --


def test_totals_report_the_run_and_the_window():
  vector = np.zeros(LAYOUT.size)
  vector[:4] = [3, 2, 1, 0]  # applied, dropped, skipped, nonfinite
  vector[4 + 0], vector[4 + 2] = 2, 1  # tau 0 twice, tau 2 once
  vector[-3:] = [3.0, 1.5, 6.0]  # sums of loss, accuracy, grad_norm
  record = LAYOUT.read(vector)
  assert record.means() == {"loss": 1.0, "accuracy": 0.5, "grad_norm": 2.0}
  totals = stats.Totals()
  totals.add(record)
  totals.add(record)
  assert totals.scalars() == {"ps/dropped": 4.0, "ps/skipped_pushes": 2.0}
  window = totals.take_window()
  assert window.samples().tolist() == [0, 0, 0, 0, 2, 2]
  assert totals.take_window().total == 0  # A new window starts empty.
  summary = totals.summary()
  assert summary["ps_staleness_counts"] == {"0": 4, "2": 2}
  assert (summary["ps_dropped"], summary["ps_skipped_pushes"]) == (4, 2)
  with pytest.raises(ValueError, match="expected"):
    LAYOUT.read(np.zeros(LAYOUT.size + 1))


def test_fetch_add_gives_every_caller_its_own_value():
  variable = tf.Variable(0, dtype=tf.int64)
  # Eight increments without dependencies between them, free to run at once.
  values = tf.function(lambda: [counter.fetch_add(variable)
                                for _ in range(8)], autograph=False)()
  assert sorted(int(v) for v in values) == list(range(8))
  assert int(variable.numpy()) == 8


class _Coordinator:
  def __init__(self, done_after_s):
    self.ready_at = time.monotonic() + done_after_s
    self.joined = False

  def done(self):
    return time.monotonic() >= self.ready_at

  def join(self):
    self.joined = True


def test_waiting_for_a_round_is_bounded():
  coordinator = _Coordinator(done_after_s=0.2)
  trainer.wait_for_round(coordinator, timeout_s=5, step=0, num_workers=2)
  assert coordinator.joined
  stuck = _Coordinator(done_after_s=1e9)
  t0 = time.monotonic()
  with pytest.raises(ClusterError, match="are all 2 workers down"):
    trainer.wait_for_round(stuck, timeout_s=0.3, step=40, num_workers=2)
  assert time.monotonic() - t0 < 2 and not stuck.joined


def test_a_lost_task_is_a_cluster_error_naming_the_workdir(small_config):
  config = small_config(mode="ps")
  lost = tf.errors.UnavailableError(None, None, "Socket closed")
  error = PSTrainer.cluster_error(config, PS_CLUSTER, lost)
  assert isinstance(error, ClusterError)
  assert "parameter server is unreachable" in str(error)
  assert config.workdir in str(error) and "Socket closed" in str(error)
  bad_input = tf.errors.InvalidArgumentError(None, None, "bad shape")
  assert PSTrainer.cluster_error(config, PS_CLUSTER, bad_input) is None


def test_the_mode_checks_its_flags_at_the_door(small_config):
  config = configure.validate(small_config(mode="ps"), PS_CLUSTER)
  assert config.mode_options.max_staleness == staleness.NO_BOUND
  with pytest.raises(UserError, match="use --num_devices=1"):
    configure.validate(small_config(mode="ps", num_devices=2), PS_CLUSTER)
  with pytest.raises(UserError, match="max_staleness"):
    configure.validate(small_config(mode="ps", max_staleness=-2), PS_CLUSTER)
  with pytest.raises(UserError, match="staleness_lr"):
    small_config(mode="ps", staleness_lr="inverse")


def test_workers_and_pss_serve_until_ctrl_c(monkeypatch, small_config):
  """join_cluster returns on the chief; a worker or PS task serves there
  until Ctrl-C, then exits 130 (a real SIGINT, a stand-in server).

  Python's Ctrl-C handler is installed for the test: a suite started with
  SIGINT ignored (under nohup, or as a background job) would ignore the
  signal. The serve loop's sleep sends it, from inside the loop, and
  fails the test if the server outlives it.
  """
  servers = []
  monkeypatch.setattr(tf.distribute, "Server", lambda *args, **kwargs: (
      servers.append(kwargs) or types.SimpleNamespace(target="grpc://ps")))
  monkeypatch.delenv("GRPC_FAIL_FAST", raising=False)
  naps = []

  def nap(seconds):
    assert len(naps) < 20, "the server did not stop on SIGINT"
    naps.append(seconds)
    if len(naps) == 1:
      os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)

  monkeypatch.setattr(server, "time", types.SimpleNamespace(sleep=nap))
  config = small_config(mode="ps")
  server.join_cluster(config, PS_CLUSTER)  # The chief: returns at once.
  assert not servers and os.environ["GRPC_FAIL_FAST"] == "use_caller"
  ps_task = dataclasses.replace(PS_CLUSTER, task_type="ps")
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(SystemExit) as exit_info:
      server.join_cluster(config, ps_task)
  finally:
    signal.signal(signal.SIGINT, previous)
  assert exit_info.value.code == server.EXIT_INTERRUPTED == 130
  assert naps and servers[0]["job_name"] == "ps"
  # One inter-op thread per concurrent remote call: workers + 1.
  assert servers[0]["config"].inter_op_parallelism_threads == 3


# -- a real cluster: a chief, workers and parameter servers --

STEPS = 100
KILL_WORKER_AT = 40
MAX_STALENESS = 0  # The tightest bound: every applied gradient is fresh.
# Far below every gradient's norm, so clipping acts on every push. Adam's
# update hardly depends on the gradient's scale, so the run still learns.
CLIP = 0.01


@pytest.fixture(scope="module")
def digits_shards(tmp_path_factory):
  """The digits as shards: {format: directory}. The first TFRecord file's
  record 5 is not an Example."""
  digits = data.DATASETS.get("digits")(None, 0, None)
  root = tmp_path_factory.mktemp("ps_shards")
  out = {fmt: str(root / fmt) for fmt in shard_format.FORMATS}
  for fmt, directory in out.items():
    shard_writer.write(digits, fmt, 4, directory, 0, {"dataset": "digits"})
  manifest_path = os.path.join(out["tfrecord"], shard_format.MANIFEST)
  with open(manifest_path, encoding="utf-8") as f:
    manifest = json.load(f)
  entry = manifest["splits"]["train"]["files"][0]
  path = os.path.join(out["tfrecord"], entry["name"])
  records = [r.numpy() for r in tf.data.TFRecordDataset(path)]
  records[5] = b"not an Example"
  with tf.io.TFRecordWriter(path) as w:
    for record in records:
      w.write(record)
  entry["bytes"] = os.path.getsize(path)
  with open(manifest_path, "w", encoding="utf-8") as f:
    json.dump(manifest, f)
  return out


def _command(workdir, **overrides):
  flags = dict(mode="ps", dataset="digits", model="mlp", num_devices=1,
               global_batch_size=32, optimizer="adam", learning_rate=0.003,
               precision="mixed_float16", ps_steps_per_call=4,
               max_staleness=MAX_STALENESS, clip_global_norm=CLIP,
               train_steps=STEPS, steps_per_loop=20, log_every=20,
               eval_every=1000, checkpoint_every=1000,
               collective_timeout_s=60, seed=0)
  flags.update(overrides)
  return [sys.executable, "-m", "experiments.train",
          *[f"--{k}={v}" for k, v in flags.items()], f"--workdir={workdir}"]


def _wait_for(path, text, processes, timeout=90):
  deadline = time.monotonic() + timeout
  while not (os.path.exists(path) and text in open(path).read()):
    assert time.monotonic() < deadline, f"no {text!r} in {path}"
    assert all(p.poll() is None for p in processes), f"a task ended: {path}"
    time.sleep(0.2)


def _launcher(workdir, command, num_workers, num_ps):
  return launch.Launcher(command, num_workers=num_workers, num_ps=num_ps,
                         log_dir=str(workdir / "logs"), timeout_s=150,
                         quiet=True)


def _processes(launcher):
  return [t.process for t in launcher.tasks.values()]


@pytest.fixture(scope="module")
def killed_worker_run(tmp_path_factory, digits_shards):
  """A float16 run of 100 steps on TFRecord shards of the digits, each
  worker reading its own files, a bad record skipped, every push clipped;
  worker:1 is killed at step 40.

  Two PSs: the variables are spread over both, and the lock on ps:0 still
  orders every update.
  """
  workdir = tmp_path_factory.mktemp("ps") / "run"
  command = _command(workdir, dataset="shards",
                     data_dir=digits_shards["tfrecord"],
                     skip_bad_records=True)
  launcher = _launcher(workdir, command, num_workers=2, num_ps=2)
  launcher.start()
  try:
    _wait_for(workdir / "logs" / "chief-0.log",
              f"step {KILL_WORKER_AT}/{STEPS}", _processes(launcher))
    launcher.tasks["worker:1"].signal(signal.SIGKILL)
    code = launcher.wait()
  finally:
    launcher.stop()
  chief_log = (workdir / "logs" / "chief-0.log").read_text()
  assert code == 0, chief_log[-4000:]
  assert launcher.tasks["worker:1"].poll() == -signal.SIGKILL
  with open(workdir / "summary.json", encoding="utf-8") as f:
    return workdir, json.load(f)


def test_ps_trains_digits_within_the_bound_despite_a_killed_worker(
    killed_worker_run, digits_shards):
  workdir, s = killed_worker_run
  assert s["final_step"] == STEPS and s["ps_applied"] == STEPS
  assert s["eval_accuracy"] > 0.9
  assert s["ps_workers"] == 2 and s["ps_servers_holding_weights"] == 2
  # Every applied update was within the bound when it was applied. With two
  # workers and a bound of 0, some gradients were stale: they were dropped.
  counts = {int(t): c for t, c in s["ps_staleness_counts"].items()}
  assert max(counts) <= MAX_STALENESS and s["ps_staleness_max"] == 0
  assert s["ps_dropped"] > 0
  # The kill may cut one locked step short after some of its ordered
  # writes (weights and the optimizer's counter, `step`, the record): at
  # most one update is part-done, and none is counted twice.
  assert STEPS <= s["ps_optimizer_iterations"] <= STEPS + 1
  assert STEPS - 1 <= sum(counts.values()) <= STEPS
  # The loss scale lives on a PS and is checkpointed; each halving (below
  # the initial 2**15; no growth within 2000 steps) skipped a push.
  saved = tf.train.load_checkpoint(str(workdir / "checkpoints"))
  name = [k for k in saved.get_variable_to_shape_map()
          if k.startswith("loss_scale/scale")]
  halvings = 15 - np.log2(saved.get_tensor(name[0]))
  assert halvings == int(halvings) and 0 <= halvings <= 15
  assert s["ps_skipped_pushes"] >= halvings
  # What the mode reports at each log line reaches TensorBoard.
  tags = set(read_events(str(workdir / LOGDIR)))
  assert {"train/ps/applied", "train/ps/dropped", "train/ps/skipped_pushes",
          "train/ps/staleness", "train/ps/staleness_mean",
          "train/ps/staleness_max", "train/ps/drops_per_update",
          "train/grad_norm", "train/loss_scale"} <= tags
  assert "train/ps/updates_per_sec" not in tags
  # The bad record, once in each epoch of the input that reads its file
  # (files 0 and 2 of 4; at most every step's batch from it, plus a read
  # ahead): the run's count, on the chief, which the workers' inputs add to.
  with open(os.path.join(digits_shards["tfrecord"], shard_format.MANIFEST),
            encoding="utf-8") as f:
    counts = shard_format.counts(json.load(f), "train")
  assert 1 <= s["bad_records"] <= STEPS * 32 // (counts[0] + counts[2]) + 2
  assert 1 <= max(read_events(str(workdir / LOGDIR))[
      "train/data/bad_records"].values()) <= s["bad_records"]
  # The checkpoint has the names of every other mode: a plain model reads it.
  config = configure.make_config(workdir=str(workdir), dataset="digits",
                                 model="mlp")
  model = weights.load_model(config)
  accuracy = Evaluator(model, load_data(config), 256).evaluate()
  np.testing.assert_allclose(accuracy["eval/accuracy"], s["eval_accuracy"],
                             atol=1e-6)
  _assert_every_push_was_clipped(workdir, model)


def _assert_every_push_was_clipped(workdir, model):
  """Clipping acted on every applied push, on its worker: each log line's
  fraction is 1 while the norm it reports (before clipping) is far above
  the bound; and Adam's second moments, read from the checkpoint, hold a
  gradient of global norm CLIP at every applied update.

  Adam's velocity v is an average of squared gradients: after n updates of
  global norm g_t, sum(v) = (1 - b2) * sum_t b2**(n - t) * g_t**2, which is
  CLIP**2 * (1 - b2**n) if every g_t is CLIP. Unclipped, the norms the log
  lines report (over 10 * CLIP) make it over 100 times larger. The one
  update the kill may leave part-done (see the calling test) moves it by
  about 1%; a checkpoint not read would leave n = 0.
  """
  events = read_events(str(workdir / LOGDIR))
  clipped = events["train/clipped_fraction"]
  assert sorted(clipped) == sorted(events["train/loss"])  # Every log line.
  assert set(clipped.values()) == {1.0}
  assert min(events["train/grad_norm"].values()) > 10 * CLIP
  adam = optim.make("adam", 0.003, model.trainable_variables)
  tf.train.Checkpoint(optimizer=adam).read(
      tf.train.latest_checkpoint(str(workdir / "checkpoints"))
  ).expect_partial()
  n = int(adam.iterations.numpy())
  assert STEPS <= n <= STEPS + 1
  velocity = sum(float(tf.reduce_sum(v)) for v in adam.variables
                 if "velocity" in v.name)
  assert velocity == pytest.approx(CLIP**2 * (1 - adam.beta_2**n), rel=0.02)


def test_a_killed_ps_stops_the_run_and_a_rerun_resumes(killed_worker_run,
                                                       digits_shards,
                                                       tmp_path):
  """A new, smaller cluster resumes (a copy of) the finished run, on
  ArrayRecord shards of the same digits (read by the chief's Python, for
  the worker) and without --skip_bad_records, so its checkpoint holds a
  count this run does not keep; then its PS is killed. The chief says so in
  one line: TensorFlow's and gRPC's error text about the lost task is
  hidden."""
  workdir = tmp_path / "run"
  shutil.copytree(killed_worker_run[0], workdir)
  command = _command(workdir, train_steps=100000, dataset="shards",
                     data_dir=digits_shards["arrayrecord"])
  launcher = _launcher(workdir, command, num_workers=1, num_ps=1)
  launcher.start()
  chief_log = workdir / "logs" / "chief-0.log"
  try:
    _wait_for(chief_log, f"step {STEPS + 20}/100000", _processes(launcher))
    launcher.tasks["ps:0"].signal(signal.SIGKILL)
    # Not `launcher.wait()`: it would stop the chief as soon as the PS
    # died; here the chief must notice by itself, and say so.
    code = launcher.tasks["chief:0"].process.wait(timeout=90)
  finally:
    launcher.stop()
  text = chief_log.read_text()
  assert code == 1, text[-4000:]
  assert f"Resumed from {workdir / 'checkpoints' / f'ckpt-{STEPS}'}" in text
  errors = [line for line in text.splitlines() if "error" in line.lower()]
  assert len(errors) == 1, text[-4000:]
  assert errors[0].startswith("error: a parameter server is unreachable")
  assert "Traceback" not in text
  assert not re.search(r"^[IWEF]\d{4} ", text, re.MULTILINE), text[-4000:]
