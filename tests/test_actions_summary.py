"""The Summary action alone (dist_loop/control/actions/summary.py): summary.json
from its parts, the steady-state throughput, off the chief, and a write
that fails."""

import errno
import json

import pytest

from controller_fakes import FakeSummaries
from dist_loop.control import actions
from dist_loop.control.actions import summary as summary_lib
from dist_loop.core.errors import UserError


def _loop(start, end, skipped=0, seconds=1.0):
  return actions.Loop(start, end, {"train/loss": 1.0}, skipped,
                      (end - start) * 8, seconds, skipped)


def _summary(tmp_path, parts=(), newest=lambda: 20, path="summary.json"):
  summaries = FakeSummaries([])
  action = actions.Summary(path and str(tmp_path / path), summaries,
                           list(parts), newest)
  return action, summaries


def test_summary_totals_exclude_the_first_loop_which_traces(tmp_path):
  action, summaries = _summary(tmp_path)
  action.observe(_loop(0, 1, seconds=100.0))  # The trace.
  action.observe(_loop(1, 10, skipped=3, seconds=2.0))
  action.observe(_loop(10, 20, seconds=3.0))
  action(20)
  written = json.loads((tmp_path / "summary.json").read_text())
  assert written == pytest.approx(action.written)
  assert written["final_step"] == 20 and written["skipped_steps"] == 3
  assert written["examples_per_sec"] == pytest.approx(19 * 8 / 5)
  assert written["updates_per_sec"] == pytest.approx(16 / 5)
  assert summaries.final_summary == action.written
  # With one loop, it is all there is.
  alone, _ = _summary(tmp_path / "alone")
  alone.observe(_loop(0, 4, seconds=2.0))
  alone(4)
  assert alone.written["updates_per_sec"] == 2.0


def test_summary_merges_its_parts_in_order(tmp_path):
  action, _ = _summary(tmp_path, parts=[
      lambda: {"train_loss": 1.0, "x": 1},
      lambda: {"eval_bits_per_byte": 1.5},
      lambda: {"x": 2, "diverged": None}])
  action(0)
  written = json.loads((tmp_path / "summary.json").read_text())
  assert written["x"] == 2 and written["diverged"] is None
  assert written["eval_bits_per_byte"] == 1.5
  assert "eval_accuracy" not in written


def test_summary_off_the_chief_is_built_but_not_written(tmp_path):
  action, summaries = _summary(tmp_path, path=None)
  action(5)
  assert action.written["final_step"] == 5
  assert summaries.final_summary["final_step"] == 5
  assert not list(tmp_path.iterdir())


def test_a_summary_that_cannot_be_written_names_it_and_the_checkpoint(
    tmp_path, monkeypatch):
  def full(path, data):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(summary_lib, "atomic_write_json", full)
  action, _ = _summary(tmp_path, newest=lambda: 120)
  with pytest.raises(UserError) as e:
    action(120)
  message = str(e.value)
  assert message.startswith(f"cannot write {tmp_path / 'summary.json'} (No "
                            "space left on device)")
  assert "its newest checkpoint, of step 120, is saved" in message
  nothing, _ = _summary(tmp_path, newest=lambda: None)
  with pytest.raises(UserError, match="no checkpoint was saved"):
    nothing(3)
