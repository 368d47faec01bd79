"""Goodput accounting: the record of every attempt, the totals across them,
and what a run writes (summary.json, TensorBoard). A SIGKILLed and resumed
run's lost work is test_async_checkpoint.py's (the kill lands mid-save)."""

import json
import os

import pytest

from conftest import read_events, run_tool
from dist_loop import train
from dist_loop.runtime import goodput
from dist_loop.runtime.summaries import LOGDIR
from tools import goodput as goodput_tool


class _Clock(goodput.Clock):
  """A clock that started at `started` (a wall time) with no start-up."""

  def __init__(self, started):  # pylint: disable=super-init-not-called
    self.started = started
    self.phases = {"import": 0.0}


def test_a_resumed_attempt_counts_the_steps_it_trains_again(tmp_path,
                                                            monkeypatch):
  """Attempt 1 reaches step 30 (its checkpoint: 20) and dies; attempt 2
  restores step 20 and trains to 40: steps 21..30 are recomputed, and the
  gap between the attempts is downtime."""
  path = str(tmp_path / goodput.GOODPUT_FILE)
  now = [1000.0]
  monkeypatch.setattr(goodput.time, "time", lambda: now[0])
  first = goodput.Recorder(path, _Clock(990.0))
  first.restore(None, 0.0)
  for start in (0, 10, 20):
    now[0] += 2.0
    first.loop(start, start + 10, 2.0)
  died = now[0]
  now[0] += 50.0
  second = goodput.Recorder(path, _Clock(died + 45.0))
  assert second.furthest == 30
  second.restore(20, 1.0)
  for start in (20, 25, 30, 35):
    now[0] += 1.0
    second.loop(start, start + 5, 1.0)
  second.write(final=True)
  attempts = goodput.read(path)
  assert [a["restored"] for a in attempts] == [0, 20]
  assert attempts[1]["steps"] == {"recomputed": 10, "productive": 10}
  assert attempts[1]["phases"]["recomputed"] == pytest.approx(2.0)
  totals = goodput.totals(attempts)
  assert totals["downtime"] == pytest.approx(45.0)
  assert totals["recomputed_steps"] == 10
  # The phases of each attempt add up to its wall time.
  for attempt in attempts:
    assert sum(attempt["phases"].values()) == pytest.approx(
        attempt["t"] - attempt["started"])
  assert totals["wall"] == pytest.approx(now[0] - 990.0)


def test_a_line_cut_short_is_ignored_and_a_bad_one_is_corrupt(tmp_path):
  path = str(tmp_path / goodput.GOODPUT_FILE)
  recorder = goodput.Recorder(path, _Clock(0.0))
  recorder.loop(0, 5, 1.0)
  recorder.loop(5, 10, 1.0)
  with open(path, "a", encoding="utf-8") as f:
    f.write('{"started": 1.0, "pid"')  # A crash mid-write.
  [attempt] = goodput.read(path)
  assert attempt["step"] == 10
  with open(path, "a", encoding="utf-8") as f:
    f.write("\n")  # Now a complete line that is not a record.
  with pytest.raises(goodput.CorruptRecord, match="line 3"):
    goodput.read(path)
  # A run on that workdir goes on, without the attempts it cannot read.
  assert goodput.Recorder(path, _Clock(1.0)).earlier == []


def test_young_daly_interval_is_the_least_waste():
  cost, mtbf = 4.0, 3600.0
  best = goodput.optimal_interval_s(cost, mtbf)
  assert best == pytest.approx((2 * cost * mtbf) ** 0.5)
  waste = goodput.interval_waste(best, cost, mtbf)
  assert waste < goodput.interval_waste(best * 0.8, cost, mtbf)
  assert waste < goodput.interval_waste(best * 1.25, cost, mtbf)


def test_a_run_and_its_resume_record_where_the_time_went(small_config):
  config = small_config(train_steps=10)
  train.run(config)
  summary = train.run(small_config(train_steps=20))
  attempts = goodput.read(os.path.join(config.workdir, goodput.GOODPUT_FILE))
  assert len(attempts) == 2 and all(a["final"] for a in attempts)
  assert [a["restored"] for a in attempts] == [0, 10]
  assert [a["steps"]["productive"] for a in attempts] == [10, 10]
  assert attempts[1]["saves"] >= 1 and attempts[1]["phases"]["checkpoint"] > 0
  with open(os.path.join(config.workdir, "summary.json"),
            encoding="utf-8") as f:
    written = json.load(f)
  assert written["goodput_attempts"] == 2 == summary["goodput_attempts"]
  phases = sum(written[f"goodput_{p}_s"] for p in goodput.PHASES)
  assert written["goodput_wall_s"] == pytest.approx(
      phases + written["goodput_downtime_s"])
  assert 0 < written["goodput"] < 1
  assert written["goodput_downtime_s"] > 0
  plot = os.path.join(os.path.dirname(config.workdir), "goodput.png")
  result = run_tool("tools.goodput", config.workdir, f"--plot={plot}",
                    "--expected_failure_interval_s=600")
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert [line.split(" | ")[0] for line in lines if line.startswith(
      "| chief") or line.startswith("| total")] == [
          "| chief 1", "| chief 2", "| total"]
  best = goodput.optimal_interval_s(
      written["goodput_checkpoint_s"] / sum(a["saves"] for a in attempts),
      600)
  assert f"the best interval is {best:.1f} s" in result.stdout
  assert os.path.getsize(plot) > 0
  events = read_events(os.path.join(config.workdir, LOGDIR))
  assert set(events["train/goodput/goodput"]) == {5, 10, 15, 20}
  assert events["train/goodput/productive_s"][20] == pytest.approx(
      written["goodput_productive_s"], rel=0.05)


def test_bad_input_to_the_tool_is_one_line_and_exit_code_2(tmp_path):
  with pytest.raises(goodput_tool.BadInput, match="not a directory"):
    goodput_tool.load(str(tmp_path / "missing"))
  with pytest.raises(goodput_tool.BadInput, match="holds no goodput record"):
    goodput_tool.load(str(tmp_path))
  (tmp_path / goodput.GOODPUT_FILE).write_text("garbage\n")
  result = run_tool("tools.goodput", str(tmp_path), "--plot=")
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      f"error: {tmp_path / goodput.GOODPUT_FILE}, line 1: not a goodput "
      "record (JSONDecodeError); move the file aside to read the others"]
