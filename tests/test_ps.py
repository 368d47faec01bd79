"""Parameter-server mode: a chief, two workers and a parameter server.

Trains `digits` to a sensible accuracy with the staleness bound respected
and every update counted; a worker killed mid-run is ridden out; a killed
parameter server stops the run with a clear error, and rerunning resumes.
"""

import json
import os
import signal
import sys
import time
import types

import numpy as np
import pytest
import tensorflow as tf

from conftest import run_launch
from dist_loop import Config, checkpoints, optim
from dist_loop.evaluation import Evaluator
from dist_loop.data import DATASETS
from dist_loop.modes import ps as ps_mode
from dist_loop.modes.ps import PSTrainer

from tools import launch

MAX_STALENESS = 0  # The tightest bound: every applied gradient is fresh.


def _command(workdir, **overrides):
  flags = dict(mode="ps", num_devices=1, global_batch_size=32,
               optimizer="adam", learning_rate=0.003, ps_steps_per_call=4,
               steps_per_loop=40, log_every=40, eval_every=1000,
               checkpoint_every=1000, collective_timeout_s=30, seed=0)
  flags.update(overrides)
  return [sys.executable, "-m", "experiments.train",
          *[f"--{k}={v}" for k, v in flags.items()], f"--workdir={workdir}"]


def _summary(workdir):
  with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
    return json.load(f)


def test_ps_trains_digits_within_the_staleness_bound(tmp_path):
  workdir = tmp_path / "run"
  steps = 400
  result = run_launch("--num_workers=2", "--num_ps=1", "--",
                      *_command(workdir, dataset="digits", model="mlp",
                                train_steps=steps,
                                max_staleness=MAX_STALENESS), timeout=150)
  assert result.returncode == 0, result.stdout[-4000:]
  s = _summary(workdir)
  print({k: v for k, v in s.items() if k.startswith(("ps_", "eval"))})
  assert s["final_step"] == steps
  assert s["eval_accuracy"] > 0.9
  # Every applied update was counted exactly once, by the atomic counter,
  # and had a staleness within the bound when it was applied.
  assert s["ps_applied"] == steps
  counts = {int(t): c for t, c in s["ps_staleness_counts"].items()}
  assert sum(counts.values()) == steps
  assert max(counts) <= MAX_STALENESS
  assert s["ps_staleness_max"] <= MAX_STALENESS
  assert s["ps_dropped"] >= 0 and s["ps_workers"] == 2
  # Every applied update moved the optimizer once, and only those did.
  assert s["ps_optimizer_iterations"] == steps
  # The checkpoint has the names of every other mode: a plain model reads it.
  config = Config(workdir=str(workdir), dataset="digits", model="mlp")
  model = checkpoints.load_model(config)
  split = DATASETS.get("digits")(None, 0, None)
  accuracy = Evaluator(model, split, 256).evaluate()["eval/accuracy"]
  np.testing.assert_allclose(accuracy, s["eval_accuracy"], atol=1e-6)


def _ancestors(op):
  """Every op that `op` waits for, by data or control edges."""
  seen, stack = {}, [op]
  while stack:
    op = stack.pop()
    if op.name not in seen:
      seen[op.name] = op
      stack += [t.op for t in op.inputs] + list(op.control_inputs)
  return list(seen.values())


def _stand_in_trainer(variable, step, loss_scale=None):
  """A PSTrainer without a cluster: its variables are local, under the
  default strategy, and only what `_decide_and_apply` reads is set."""
  trainer = PSTrainer.__new__(PSTrainer)
  trainer.config = types.SimpleNamespace(max_staleness=0)
  trainer.step = step
  trainer.optimizer = optim.make("sgd", 1.0, [variable])
  trainer.model = types.SimpleNamespace(trainable_variables=[variable])
  trainer.loss_scale = loss_scale
  trainer._lock = tf.CriticalSection()  # pylint: disable=protected-access
  trainer._stats = tf.Variable(tf.zeros([ps_mode._NUM_STATS], tf.float64))  # pylint: disable=protected-access
  fn = tf.function(
      lambda g, read, target, loss, scale: trainer._decide_and_apply(  # pylint: disable=protected-access
          [g], read, target, loss, scale, accuracy=tf.constant(0.5),
          grad_norm=tf.linalg.global_norm([g])))

  def call(grad, read, target=100, loss=1.0, scale=1.0):
    out = fn(tf.constant(grad, tf.float32), tf.constant(read, tf.int64),
             tf.constant(target, tf.int64), tf.constant(loss, tf.float32),
             tf.constant(scale, tf.float32))
    return {k: x.numpy() for k, x in out.items()}

  return trainer, fn, call


def test_decide_and_apply_is_one_locked_step():
  """The PS-side decision, update and count, on a stand-in trainer."""
  v = tf.Variable([1.0, 2.0])
  step = tf.Variable(5, dtype=tf.int64)
  trainer, fn, call = _stand_in_trainer(v, step)
  g = [1.0, 1.0]
  out = call(g, 4)  # One update since the read: too stale for a bound of 0.
  assert (not out["applied"] and out["dropped"] and out["tau"] == 1
          and step.numpy() == 5 and v.numpy().tolist() == [1.0, 2.0])
  out = call(g, 5)  # Fresh: applied, and counted once.
  assert out["applied"] and out["tau"] == 0 and out["step"] == 6
  assert v.numpy().tolist() == [0.0, 1.0]
  assert int(trainer.optimizer.iterations.numpy()) == 1
  out = call(g, 6, target=6)  # Fresh, but this call's budget is spent.
  assert not out["applied"] and not out["dropped"] and step.numpy() == 6
  out = call([np.inf, 1.0], 6)  # No loss scaling: a real non-finite step.
  assert out["nonfinite"] and not out["skipped"] and not out["applied"]
  # Each outcome was recorded with it, under the lock; the staleness
  # histogram and the sums hold applied updates only.
  totals, taus = trainer._read_stats()  # pylint: disable=protected-access
  assert totals == pytest.approx({
      "applied": 1, "dropped": 1, "skipped": 0, "nonfinite": 1,
      "loss": 1.0, "accuracy": 0.5, "grad_norm": np.sqrt(2.0)})
  assert taus[0] == 1 and taus.sum() == 1
  # The lock is released (ConsumeMutexLock) only after the optimizer's
  # update (an If: it runs only if applied) and the step increment.
  spec = tf.TensorSpec([], tf.float32)
  graph = fn.get_concrete_function(
      tf.TensorSpec([2], tf.float32), tf.TensorSpec([], tf.int64),
      tf.TensorSpec([], tf.int64), spec, spec).graph
  release = [op for op in graph.get_operations()
             if op.type == "ConsumeMutexLock"]
  assert len(release) == 1
  waits_for = _ancestors(release[0])

  def updates(variable, op_types):
    handle = [internal for external, internal in graph.captures
              if external is variable.handle]
    assert handle, f"{variable.name} is not used in the step"
    return [op for op in waits_for if op.type in op_types
            and any(t is handle[0] for t in op.inputs)]

  # The weight update (in a cond: it runs only if applied), the step count
  # and the optimizer's own counter all happen before the release.
  assert updates(v, ("If", "StatelessIf")), "the update is outside the lock"
  assert updates(step, ("AssignAddVariableOp",))
  assert updates(optim._tf_variable(trainer.optimizer.iterations),  # pylint: disable=protected-access
                 ("AssignAddVariableOp",))
  recorded = updates(trainer._stats, ("AssignAddVariableOp",))  # pylint: disable=protected-access
  # In order: the weights, then the count, then the record, so a step cut
  # short leaves at most one update part-done (see the ps module).
  counted = updates(step, ("AssignAddVariableOp",))
  assert recorded and counted
  assert counted[0] in _ancestors(recorded[0])
  assert updates(v, ("If", "StatelessIf"))[0] in _ancestors(counted[0])


def test_fp16_overflow_is_skipped_and_halves_the_scale_once():
  from dist_loop.precision import DynamicLossScale  # pylint: disable=g-import-not-at-top
  v = tf.Variable([1.0, 2.0])
  step = tf.Variable(5, dtype=tf.int64)
  scale = DynamicLossScale(initial_scale=2.0 ** 10)
  trainer, _, call = _stand_in_trainer(v, step, scale)
  inf = [np.inf, 1.0]
  out = call(inf, 5, scale=2.0 ** 10)  # Overflow at the scale in force.
  assert out["skipped"] and not out["nonfinite"] and not out["applied"]
  assert scale.scale.numpy() == 2.0 ** 9 and step.numpy() == 5
  assert v.numpy().tolist() == [1.0, 2.0]
  assert int(trainer.optimizer.iterations.numpy()) == 0
  out = call(inf, 5, scale=2.0 ** 10)  # At the old scale: no second halving.
  assert out["skipped"] and scale.scale.numpy() == 2.0 ** 9
  out = call([1.0, 1.0], 5, scale=2.0 ** 9)  # A good step: applied, counted.
  assert out["applied"] and step.numpy() == 6
  assert int(scale.good_steps.numpy()) == 1
  # The skipped steps' infinite gradient norms are left out of the sums.
  totals, _ = trainer._read_stats()  # pylint: disable=protected-access
  assert totals["skipped"] == 2 and totals["applied"] == 1
  assert totals["grad_norm"] == pytest.approx(np.sqrt(2.0))
  out = call(inf, 6, loss=np.nan, scale=2.0 ** 9)  # A NaN loss is real.
  assert out["nonfinite"] and not out["skipped"]
  scale.scale.assign(1.0)
  out = call(inf, 6, scale=1.0)  # At the floor, nothing is left to unscale.
  assert out["nonfinite"] and not out["skipped"] and scale.scale.numpy() == 1


def _wait_for(path, text, launcher, timeout=90):
  deadline = time.monotonic() + timeout
  while not (os.path.exists(path) and text in open(path).read()):
    assert time.monotonic() < deadline, f"no {text!r} in {path}"
    assert all(t.poll() is None for t in launcher.tasks.values())
    time.sleep(0.2)


def test_a_killed_worker_is_ridden_out(tmp_path):
  # Two parameter servers: the variables are spread over both, and the
  # update lock on ps:0 still orders every update (one count, no loss).
  # In float16, so that the loss-scaled path runs across the cluster too.
  workdir = tmp_path / "run"
  steps = 400
  launcher = launch.Launcher(
      # A round that runs into the kill also absorbs noticing it and
      # re-running the lost call: a roomy bound on it.
      _command(workdir, dataset="synthetic", model="mlp", train_steps=steps,
               steps_per_loop=20, log_every=20, collective_timeout_s=60,
               precision="mixed_float16"), num_workers=2, num_ps=2,
      log_dir=str(workdir / "logs"), timeout_s=120, quiet=True)
  launcher.start()
  try:
    _wait_for(workdir / "logs" / "chief-0.log", "step 40/", launcher)
    launcher.tasks["worker:1"].signal(signal.SIGKILL)
    code = launcher.wait()
  finally:
    launcher.stop()
  assert code == 0, open(workdir / "logs" / "chief-0.log").read()[-4000:]
  assert launcher.tasks["worker:1"].poll() == -signal.SIGKILL
  s = _summary(workdir)
  assert s["final_step"] == steps and s["ps_applied"] == steps
  # The kill may cut one locked step short, after some of its ordered
  # writes (weights and the optimizer's counter, then `step`, then the
  # record): at most one update is part-done, never one counted twice.
  assert steps <= s["ps_optimizer_iterations"] <= steps + 1
  assert steps - 1 <= sum(s["ps_staleness_counts"].values()) <= steps
  assert s["ps_servers_holding_weights"] == 2
  saved = tf.train.load_checkpoint(str(workdir / "checkpoints"))
  scale = [k for k in saved.get_variable_to_shape_map()
           if k.startswith("loss_scale/scale")]
  assert scale and saved.get_tensor(scale[0]) >= 1.0


def test_a_killed_ps_stops_the_run_and_a_rerun_resumes(tmp_path):
  workdir = tmp_path / "run"
  command = _command(workdir, dataset="synthetic", model="mlp",
                     train_steps=100000, steps_per_loop=20, log_every=20,
                     checkpoint_every=40)
  launcher = launch.Launcher(command, num_workers=2, num_ps=1,
                             log_dir=str(workdir / "logs"), timeout_s=120,
                             quiet=True)
  launcher.start()
  try:
    _wait_for(workdir / "logs" / "chief-0.log", "saved checkpoint", launcher)
    launcher.tasks["ps:0"].signal(signal.SIGKILL)
    # Not `launcher.wait()`: the launcher would stop the chief as soon as
    # the PS died; here the chief must notice by itself, and say so.
    code = launcher.tasks["chief:0"].process.wait(timeout=90)
  finally:
    launcher.stop()
  chief_log = open(workdir / "logs" / "chief-0.log").read()
  assert code == 1, chief_log[-4000:]
  assert "error: a parameter server is unreachable" in chief_log
  assert "Traceback" not in chief_log
  saved = tf.train.latest_checkpoint(str(workdir / "checkpoints"))
  saved_step = int(saved.rsplit("-", 1)[1])
  # A new cluster, the same command (fewer steps, so it ends): it resumes.
  final = saved_step + 20
  result = run_launch("--num_workers=2", "--num_ps=1", "--",
                      *_command(workdir, dataset="synthetic", model="mlp",
                                train_steps=final, steps_per_loop=20,
                                log_every=20, checkpoint_every=40),
                      timeout=150)
  assert result.returncode == 0, result.stdout[-4000:]
  assert f"Resumed from {saved}" in result.stdout
  assert _summary(workdir)["final_step"] == final
