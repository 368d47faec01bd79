"""The controller with a fake trainer, evaluator and checkpointer
(tests/controller_fakes.py): scheduling, the step check, the non-finite
policies, signals and summary.json, without training."""

import json
import os
import signal
import threading

import numpy as np
import pytest

from controller_fakes import EXAMPLES_PER_STEP, ReportingTrainer
from controller_fakes import run as _run
from dist_loop.errors import Interrupted, NonFiniteError, UserError

def _events(log, kind):
  return [e[1] for e in log if e[0] == kind]


# -- the schedule --


def test_events_land_on_exact_steps(tmp_path):
  run = _run(tmp_path, train_steps=23, log_every=5, eval_every=7,
             checkpoint_every=10, profile_steps="12,14")
  # Each inner loop stops at the next event (or after steps_per_loop).
  ends = [e[1] + e[2] for e in run.log if e[0] == "train"]
  assert ends == [5, 7, 10, 11, 14, 15, 20, 21, 23]
  assert sorted(run.scalar["train/loss"]) == [5, 10, 15, 20, 23]
  assert _events(run.log, "eval") == [7, 14, 21, 23]
  assert _events(run.log, "save") == [10, 20, 23]
  # The graph of the first loop; a profile of exactly steps 12..14.
  assert run.log[0] == ("trace_begin",) and run.log[2] == ("trace_end", 5)
  begin = run.log.index(("profile_begin",))
  end = run.log.index(("profile_end",))
  assert run.log[begin + 1] == run.log[end - 1] == ("train", 11, 3)


def test_the_log_line_averages_the_steps_since_the_last_one(tmp_path):
  run = _run(tmp_path, train_steps=10, log_every=10, eval_every=3)
  # Loops end at 3, 6, 9, 10: a step-weighted mean is the mean of 1/s.
  assert run.scalar["train/loss"][10] == pytest.approx(
      np.mean([1 / s for s in range(1, 11)]))
  assert run.scalar["train/learning_rate"] == {10: 0.25}
  for name in ("train/examples_per_sec", "train/steps_per_sec",
               "train/updates_per_sec", "memory/peak_rss_mb"):
    assert run.scalar[name][10] > 0


def test_a_finished_run_evaluates_once_and_does_not_save_again(tmp_path):
  run = _run(tmp_path, start=20)
  assert not _events(run.log, "train") and ("trace_begin",) not in run.log
  assert _events(run.log, "eval") == [20]
  assert run.saved == [20]  # The restored checkpoint, not a new one.
  assert run.result["final_step"] == 20 and run.result["eval_loss"] == 0.1
  assert run.result["train_loss"] is None


def test_the_step_counter_must_advance_by_n(tmp_path):
  result = _run(tmp_path, lag=1).result
  assert isinstance(result, RuntimeError)
  assert "step counter is at 4 after training from 0 to 5" in str(result)


# -- the non-finite policies --


def test_raise_stops_at_the_step(tmp_path):
  run = _run(tmp_path, nan=[13])
  assert isinstance(run.result, NonFiniteError) and run.result.step == 13
  assert run.scalar["nonfinite/at_step"] == {13: 13}
  assert run.trainer.restores == 0 and not _events(run.log, "restore")
  assert not (tmp_path / "summary.json").exists()


def test_skip_counts_the_skipped_steps_and_not_their_updates(tmp_path):
  run = _run(tmp_path, nonfinite="skip", skip=[7, 8, 14])
  assert run.result["skipped_steps"] == 3
  assert run.scalar["nonfinite/skipped_steps"] == {5: 0, 10: 2, 15: 3, 20: 3}
  at10 = {k: v[10] for k, v in run.scalar.items() if 10 in v}
  assert at10["train/updates_per_sec"] == pytest.approx(
      at10["train/steps_per_sec"] * 3 / 5)
  # Steady state (the first loop, which traces, excluded): steps 6-20,
  # 15 steps of which 12 applied.
  assert run.result["updates_per_sec"] == pytest.approx(
      run.result["examples_per_sec"] / EXAMPLES_PER_STEP * 12 / 15)


def test_rollback_restores_the_last_checkpoint_and_goes_on(tmp_path):
  run = _run(tmp_path, nonfinite="rollback", nan=[13])
  assert run.result["final_step"] == 20 and run.result["rollbacks"] == 1
  assert run.trainer.restores == 1
  restore = run.log.index(("restore", 10))
  assert run.log[restore - 1] == ("train", 10, 5)  # Failed at 13,
  assert run.log[restore + 1] == ("train", 10, 5)  # replayed from 10.
  assert run.scalar["nonfinite/at_step"] == {13: 13}
  assert run.scalar["nonfinite/rollbacks"] == {13: 1}


def test_rollback_gives_up_after_max_rollbacks(tmp_path):
  run = _run(tmp_path, nonfinite="rollback", nan=[13], nan_times=10,
             max_rollbacks=2)
  assert isinstance(run.result, UserError)
  assert "at step 13 after 2 rollbacks" in str(run.result)
  assert run.trainer.restores == 2 and len(_events(run.log, "restore")) == 2


def test_rollback_needs_a_checkpoint(tmp_path):
  result = _run(tmp_path, nonfinite="rollback", nan=[3]).result
  assert isinstance(result, UserError)
  assert "no checkpoint to roll back to" in str(result)


# -- signals --


def _sigterm_at(step):
  def on_train(start, n):
    if start < step <= start + n:
      os.kill(os.getpid(), signal.SIGTERM)
  return on_train


def test_sigterm_saves_at_the_end_of_the_loop_and_exits_143(tmp_path):
  before = signal.getsignal(signal.SIGTERM)
  run = _run(tmp_path, on_train=_sigterm_at(7), checkpoint_every=100)
  assert isinstance(run.result, Interrupted) and run.result.exit_code == 143
  assert run.result.step == 10 and run.saved == [10]
  assert not _events(run.log, "exit")  # Saved well within the grace period.
  assert signal.getsignal(signal.SIGTERM) is before
  assert not (tmp_path / "summary.json").exists()


def test_sigterm_exits_143_after_the_grace_period_if_the_loop_hangs(
    tmp_path):
  exited = threading.Event()

  def hang(start, n):
    _sigterm_at(7)(start, n)
    if start < 7 <= start + n:  # Waits for the watchdog, as a hung loop.
      assert exited.wait(timeout=30), "the watchdog did not fire"

  run = _run(tmp_path, on_train=hang, grace_period_s=0.2, on_exit=exited.set)
  assert run.log.index(("exit", 143)) < run.log.index(("save", 10))
  assert isinstance(run.result, Interrupted) and run.saved == [10]


def test_ctrl_c_saves_the_current_step(tmp_path):
  def interrupt(start, n):
    if start == 5:
      raise KeyboardInterrupt

  run = _run(tmp_path, on_train=interrupt)
  assert isinstance(run.result, Interrupted) and run.result.exit_code == 130
  assert run.saved == [5]


# -- summary.json --


def test_summary_has_every_metric_and_the_mode_report(tmp_path):
  run = _run(tmp_path, ReportingTrainer)
  with open(tmp_path / "summary.json") as f:
    written = json.load(f)
  assert written == pytest.approx(run.result)
  assert written["final_step"] == 20
  assert written["train_loss"] == pytest.approx(
      np.mean([1 / s for s in range(16, 21)]))
  assert written["train_accuracy"] == 0.5
  assert written["train_perplexity"] is None  # Not among train's metrics.
  assert written["eval_loss"] == 0.1 and written["eval_accuracy"] == 0.75
  assert written["eval_perplexity"] == 3.0
  assert written["updates_per_sec"] == pytest.approx(
      written["examples_per_sec"] / EXAMPLES_PER_STEP)
  assert written["skipped_steps"] == 0 and written["rollbacks"] == 0
  assert written["fake_total"] == 7 and written["memory_peak_rss_mb"] > 0
  assert run.scalar["fake/running"] == {5: 5, 10: 10, 15: 15, 20: 20}
  off_chief = _run(tmp_path / "worker", summary=False)
  assert off_chief.result["final_step"] == 20
  assert not (tmp_path / "worker" / "summary.json").exists()
