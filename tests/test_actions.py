"""Each action alone, with fakes (tests/controller_fakes.py): what it asks
of the schedule, what it writes, and what it puts in summary.json. The
Summary action itself: test_actions_summary.py."""

import math
import types

import numpy as np
import pytest
from absl import logging

from controller_fakes import (FakeCheckpointer, FakeSummaries, FakeTrainer,
                              ReportingTrainer, inputs)
from dist_loop.control import actions
from dist_loop.core.config import Config


def _loop(start, end, loss=None, skipped=0, seconds=1.0, **metrics):
  if loss is not None:
    metrics["train/loss"] = loss
  return actions.Loop(start, end, metrics, skipped, (end - start) * 8,
                      seconds, skipped)


def _log(summaries, previous=None, report=None,
         metric_names=("loss", "accuracy")):
  return actions.Log(10, 100, summaries, metric_names=metric_names,
                     reported_names=("loss", "accuracy", "perplexity"),
                     learning_rate=lambda step: step / 20, devices=["/device:CPU:0"],
                     report=report, previous=previous)


@pytest.fixture(name="lines")
def _lines(monkeypatch):
  out = []
  monkeypatch.setattr(logging, "info",
                      lambda fmt, *args: out.append(fmt % args))
  return out


# -- Log --


def test_log_averages_each_metric_over_the_updates_that_produced_it(lines):
  summaries = FakeSummaries([])
  log = _log(summaries)
  log.observe(_loop(0, 4, loss=1.0, **{"train/accuracy": 0.5}))  # 4 updates.
  log.observe(_loop(4, 8, loss=4.0, skipped=3,  # 1 update.
                    **{"train/accuracy": 1.0}))
  log.observe(_loop(8, 10, skipped=2,  # None: no loss, the scale as it is.
                    **{"train/loss_scale": 64.0}))
  log(10)
  at10 = {k: v[10] for k, v in summaries.scalar.items()}
  assert at10["train/loss"] == pytest.approx((4 * 1.0 + 4.0) / 5)
  assert at10["train/accuracy"] == pytest.approx((4 * 0.5 + 1.0) / 5)
  assert at10["train/loss_scale"] == 64.0
  assert at10["train/learning_rate"] == 0.5
  assert at10["nonfinite/skipped_steps"] == 5
  assert at10["train/steps_per_sec"] == pytest.approx(10 / 3)
  assert at10["train/updates_per_sec"] == pytest.approx(5 / 3)
  assert at10["train/examples_per_sec"] == pytest.approx(80 / 3)
  assert at10["memory/peak_rss_mb"] > 0
  assert lines[-1].startswith("step 10/100  loss 1.6000  acc 0.600  27 ex/s")
  assert log.last_loss == pytest.approx(1.6)


def test_a_log_line_with_no_update_applied_shows_no_loss(lines):
  summaries = FakeSummaries([])
  log = _log(summaries)
  log.observe(_loop(0, 10, loss=2.0))
  log(10)
  log.observe(_loop(10, 20, skipped=10, **{"train/loss_scale": 2.0}))
  log(20)
  assert lines[-1].startswith("step 20/100  loss -  acc -  ")
  assert 20 not in summaries.scalar["train/loss"]  # Never a 0.
  assert summaries.scalar["train/loss_scale"] == {20: 2.0}
  # summary.json keeps the last applied value.
  assert log.summary()["train_loss"] == 2.0 and log.last_loss == 2.0
  assert log.summary()["train_learning_rate"] == 1.0  # The rate at 20.


def test_a_line_after_nothing_was_trained_is_not_written(lines):
  summaries = FakeSummaries([])
  _log(summaries)(10)
  assert not lines and not summaries.scalar


def test_huge_values_are_written_with_an_exponent(lines):
  log = _log(FakeSummaries([]))
  log.observe(_loop(0, 10, loss=2.9e25, **{"train/accuracy": 0.1}))
  log(10)
  assert "loss 2.9e+25  acc 0.100" in lines[-1]


def test_the_first_loop_is_one_step_and_its_loss_is_the_reference():
  log = _log(FakeSummaries([]))
  log.start(30)
  assert log.stops(30) == 31 and log.stops(31) == 40
  log.observe(_loop(30, 31, loss=2.5))
  log.observe(_loop(31, 40, loss=99.0))
  assert log.first_loss == 2.5
  # A first step that applied nothing gives no reference: the next loss is.
  later = _log(FakeSummaries([]))
  later.start(0)
  later.observe(_loop(0, 1, skipped=1))
  later.observe(_loop(1, 10, loss=3.0))
  assert later.first_loss == 3.0


def test_an_earlier_summary_gives_the_reference_and_the_last_values():
  log = _log(FakeSummaries([]), previous={
      "first_train_loss": 2.0, "train_loss": 50.0, "train_accuracy": 0.1,
      "train_perplexity": "edited by hand", "eval_loss": 9.0,
      "train_learning_rate": 0.25})
  log.start(100)
  assert log.stops(100) == 110  # No one-step first loop: it has one.
  assert log.summary() == {"train_loss": 50.0, "train_accuracy": 0.1,
                           "train_perplexity": None, "first_train_loss": 2.0,
                           "train_learning_rate": 0.25}
  assert log.last_loss == 50.0


def test_log_asks_the_reporter_at_each_line():
  summaries = FakeSummaries([])
  trainer = ReportingTrainer([])
  trainer.value = 7
  log = _log(summaries, report=trainer.report)
  log.observe(_loop(0, 10, loss=1.0))
  log(10)
  assert summaries.scalar["fake/running"] == {10: 7.0}


def test_a_task_without_accuracy_shows_only_its_metrics(lines):
  log = _log(FakeSummaries([]), metric_names=("loss",))
  log.observe(_loop(0, 10, loss=1.0))
  log(10)
  assert lines[-1].startswith("step 10/100  loss 1.0000  80 ex/s")


# -- Evaluate, Checkpoint --


class Evaluator:
  """A language model's evaluation: no accuracy, bits per byte."""

  def evaluate(self):
    return {"eval/loss": 1.0, "eval/bits_per_byte": 1 / math.log(2)}


def test_evaluate_runs_under_the_scope_and_reports_the_tasks_names(lines):
  entered = []

  class Scope:
    def __enter__(self):
      entered.append(True)

    def __exit__(self, *exc):
      pass

  summaries = FakeSummaries([])
  evaluate = actions.Evaluate(50, Evaluator(), Scope, summaries)
  assert evaluate.summary() == {}  # Nothing evaluated yet.
  evaluate(50)
  assert entered == [True]
  assert summaries.scalar["eval/bits_per_byte"] == {50: 1 / math.log(2)}
  assert evaluate.summary() == {"eval_loss": 1.0,
                                "eval_bits_per_byte": 1 / math.log(2)}
  assert lines == ["step 50  eval/loss 1.0000  eval/bits_per_byte 1.4427"]


def test_checkpoint_saves_on_schedule_and_when_interrupted():
  trainer = FakeTrainer([])
  checkpointer = FakeCheckpointer(trainer, [])
  checkpoint = actions.Checkpoint(10, checkpointer)
  assert checkpoint.at_end and checkpoint.due(20) and not checkpoint.due(15)
  trainer.value = 20
  checkpoint(20)
  trainer.value = 23
  checkpoint.interrupted(23)
  assert checkpointer.saved == [20, 23]


# -- Histograms, Profile, TraceGraph --


class _Variable(np.ndarray):
  """A numpy array with the `path` a Keras variable has."""

  path = ""


def test_histograms_of_the_weights_and_the_probe_gradients():
  weights = []
  for path, value in (("dense/kernel", np.ones((2, 3))),
                      ("dense/bias", np.zeros(3))):
    var = value.view(_Variable)
    var.path = path
    weights.append(var)
  model = types.SimpleNamespace(trainable_variables=weights)
  calls = []

  def gradients(m, x, y):
    calls.append((m, x.tolist(), y.tolist()))
    return [np.full((2, 3), 0.5), np.full(3, -1.0)]

  got = {}
  summaries = types.SimpleNamespace(
      histograms=lambda step, values: got.update({step: values}))
  batch = (np.arange(4).reshape(2, 2), np.array([0, 1]))
  actions.Histograms(100, model, batch, gradients, summaries)(100)
  assert calls == [(model, [[0, 1], [2, 3]], [0, 1])]
  assert sorted(got[100]) == ["gradients/dense/bias", "gradients/dense/kernel",
                              "weights/dense/bias", "weights/dense/kernel"]
  np.testing.assert_array_equal(got[100]["gradients/dense/bias"], [-1] * 3)
  np.testing.assert_array_equal(got[100]["weights/dense/kernel"],
                                np.ones((2, 3)))


def test_profile_covers_exactly_its_steps():
  log = []
  profile = actions.Profile(12, 14, FakeSummaries(log))
  assert profile.stops(0) == 11 and profile.stops(11) == 14
  assert profile.stops(14) is None
  assert [s for s in range(20) if profile.due(s)] == [11, 14]
  profile.start(0)
  profile(11)
  profile(14)
  assert log == [("profile_begin",), ("profile_end",)]
  # A run resumed at step 11 starts the profile before its first loop.
  resumed = []
  actions.Profile(12, 14, FakeSummaries(resumed)).start(11)
  assert resumed == [("profile_begin",)]


def test_the_graph_is_of_the_first_loop_only():
  log = []
  trace = actions.TraceGraph(FakeSummaries(log))
  assert not trace.due(5)
  trace.start(0)
  assert trace.due(1)
  trace(1)
  assert not trace.due(5) and log == [("trace_begin",), ("trace_end", 1)]


# -- the standard list --


def test_standard_lists_the_actions_in_order(tmp_path):
  log = []
  trainer = FakeTrainer(log)
  summaries = FakeSummaries(log)
  run_inputs = inputs(trainer, log, summaries, FakeCheckpointer(trainer, log),
                      model=types.SimpleNamespace(trainable_variables=[]),
                      probe_batch=(np.zeros((1, 1)), np.zeros(1)),
                      probe_gradients=lambda m, x, y: [])
  names = [type(a).__name__ for a in actions.standard(
      Config(workdir=str(tmp_path)), run_inputs)]
  assert names == ["TraceGraph", "Log", "Evaluate", "Checkpoint", "Summary"]
  names = [type(a).__name__ for a in actions.standard(
      Config(workdir=str(tmp_path), profile_steps="2,3", histogram_every=5),
      run_inputs)]
  assert names == ["TraceGraph", "Profile", "Log", "Histograms", "Evaluate",
                   "Checkpoint", "Summary"]
