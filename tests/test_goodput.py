"""Goodput accounting: the record of every attempt, the totals across them,
the launcher's record splitting a restart's downtime, input waits, XLA's
compilation as start-up, and what a run writes (summary.json, TensorBoard,
the start-up line). A SIGKILLed and resumed run's lost work is
test_async_checkpoint.py's (the kill lands mid-save); a launched run
restarted once is test_launch.py's."""

import datetime
import json
import logging
import os
import re
import time

import pytest
import tensorflow as tf

from conftest import read_events, run_tool
from dist_loop import train
from dist_loop.parallel.modes.asynchronous.worker import Worker
from dist_loop.parallel.modes.loop import LoopTrainer
from dist_loop.runtime import files, goodput, launch_record
from dist_loop.runtime.summaries import LOGDIR
from helpers import make_trainer
from tools import goodput as goodput_tool

INPUT_DELAY_S = 0.02  # Each batch of a slowed input.
STARTUP_LINE = re.compile(
    r"start-up ([\d.]+) s: import ([\d.]+) s, join ([\d.]+) s, build "
    r"([\d.]+) s, restore ([\d.]+) s, trace ([\d.]+) s \(trace: the first "
    r"inner loop's (tracing|tracing and XLA compilation)\)")


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


def _slowed(dataset_fn):
  """`dataset_fn` whose every element comes `INPUT_DELAY_S` late, at the
  moment it is asked for (nothing prefetches after the delay)."""

  def late(x):
    time.sleep(INPUT_DELAY_S)
    return x

  def slowed(context):
    def delay(x, y):
      return tf.ensure_shape(tf.py_function(late, [x], x.dtype), x.shape), y

    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    return dataset_fn(context).map(delay).with_options(options)

  return slowed


def test_a_run_and_its_resume_record_where_the_time_went(small_config,
                                                         monkeypatch, caplog):
  """Two attempts of a run whose input is slow: each batch's delay is in
  the `input` phase, and each attempt prints its start-up line once."""
  make_iterator = LoopTrainer._make_iterator  # pylint: disable=protected-access
  monkeypatch.setattr(LoopTrainer, "_make_iterator",
                      lambda self, fn: make_iterator(self, _slowed(fn)))
  caplog.set_level(logging.INFO, logger="absl")
  config = small_config(train_steps=10)
  train.run(config)
  summary = train.run(small_config(train_steps=20))
  attempts = goodput.read(os.path.join(config.workdir, goodput.GOODPUT_FILE))
  assert len(attempts) == 2 and all(a["final"] for a in attempts)
  assert [a["restored"] for a in attempts] == [0, 10]
  assert [a["steps"]["productive"] for a in attempts] == [10, 10]
  for attempt in attempts:  # Ten batches each, every one late.
    assert attempt["phases"]["input"] >= 10 * INPUT_DELAY_S
  lines = [STARTUP_LINE.search(r.getMessage()) for r in caplog.records]
  said = [m for m in lines if m]
  assert len(said) == 2 and {m.group(7) for m in said} == {"tracing"}
  for line, attempt in zip(said, attempts):  # A known pace split the first.
    assert float(line.group(6)) == pytest.approx(
        attempt["phases"]["trace"], abs=0.1)
  assert attempts[1]["saves"] >= 1 and attempts[1]["phases"]["checkpoint"] > 0
  with open(os.path.join(config.workdir, "summary.json"),
            encoding="utf-8") as f:
    written = json.load(f)
  assert written["goodput_attempts"] == 2 == summary["goodput_attempts"]
  phases = sum(written[f"goodput_{p}_s"] for p in goodput.PHASES)
  assert written["goodput_wall_s"] == pytest.approx(
      phases + written["goodput_downtime_s"])
  # Not launched: the downtime has no parts.
  assert [k for k in written if k.startswith("goodput_downtime")] == [
      "goodput_downtime_s"]
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


def _recorded_run(tmp_path):
  """A workdir whose goodput record holds one attempt."""
  workdir = tmp_path / "run"
  (workdir / "logs").mkdir(parents=True)
  files.append_json_line(str(workdir / goodput.GOODPUT_FILE),
                         _attempt(50.0, 100.0, 11))
  return workdir


@pytest.mark.parametrize("record", [goodput.GOODPUT_FILE,
                                    "goodput.worker-1.jsonl",
                                    "logs/launch.jsonl"])
@pytest.mark.parametrize("make, kind", [(os.mkfifo, "a FIFO (pipe)"),
                                        (os.mkdir, "a directory")])
def test_a_record_that_is_not_a_file_is_one_line_not_a_hang(
    tmp_path, record, make, kind):
  """A FIFO in a record's place is refused by its kind, not opened (the
  read would wait for a writer forever)."""
  workdir = _recorded_run(tmp_path)
  path = workdir / record
  if path.exists():
    path.unlink()
  make(path)
  result = run_tool("tools.goodput", str(workdir), "--plot=", timeout=60)
  fix = ("read the goodput records without it" if record.startswith("logs")
         else "read the others")
  assert result.returncode == 2
  assert result.stdout == ""
  assert result.stderr == (f"error: {path} is {kind}, not a record; move it "
                           f"aside to {fix}\n")


@pytest.mark.parametrize("plot, message", [
    ("missing/x.png", "--plot={t}/missing/x.png: the directory {t}/missing "
     "does not exist; create it or choose another path"),
    ("/proc/x.png", "--plot=/proc/x.png: the directory /proc is not writable "
     "(No such file or directory); choose another path"),
    ("noext", "--plot={t}/noext does not end in .png; name a .png file"),
    ("run", "--plot={t}/run is a directory; name a file"),
    ("fifo.png", "--plot={t}/fifo.png is a FIFO (pipe); name a file"),
])
def test_a_plot_that_cannot_be_written_is_refused_before_the_tables(
    tmp_path, plot, message):
  """One line and exit code 2, nothing printed or written: not a
  traceback after the tables, nor a plot written to another path than the
  one named (matplotlib adds .png to a name without it)."""
  workdir = _recorded_run(tmp_path)
  os.mkfifo(tmp_path / "fifo.png")
  before = sorted(os.listdir(tmp_path))
  result = run_tool("tools.goodput", str(workdir),
                    f"--plot={os.path.join(str(tmp_path), plot)}", timeout=60)
  assert result.returncode == 2
  assert result.stdout == ""
  assert result.stderr == f"error: {message.format(t=tmp_path)}\n"
  assert sorted(os.listdir(tmp_path)) == before
  ok = tmp_path / "ok.png"
  result = run_tool("tools.goodput", str(workdir), f"--plot={ok}",
                    timeout=60)
  assert result.returncode == 0, result.stderr
  assert result.stdout.endswith(f"plot: {ok}\n")
  assert ok.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("value, message", [
    ("nan", "must be a number of seconds (0: the run's own flag), not nan"),
    ("inf", "inf is not a number in the range [0.0, 1000000000.0]"),
    ("-1", "-1.0 is not a number in the range [0.0, 1000000000.0]"),
])
def test_a_failure_interval_that_is_not_a_number_of_seconds_is_refused(
    tmp_path, value, message):
  """Refused when the flags are parsed (absl's line), not a traceback in
  Young/Daly's arithmetic."""
  result = run_tool("tools.goodput", str(_recorded_run(tmp_path)), "--plot=",
                    f"--expected_failure_interval_s={value}", timeout=60)
  assert result.returncode == 1
  assert result.stdout == ""
  assert result.stderr.splitlines()[0] == (
      f"FATAL Flags parsing error: flag --expected_failure_interval_s="
      f"{value}: {message}")
  assert "Traceback" not in result.stderr


def _attempt(started, t, pid):
  """A record's attempt of `t - started` productive seconds."""
  return {"started": started, "t": t, "pid": pid, "restored": 0, "step": 1,
          "furthest": 1, "final": False, "saves": 0,
          "steps": {"productive": 1, "recomputed": 0},
          "phases": {**dict.fromkeys(goodput.PHASES, 0.0),
                     "productive": t - started}}


def test_the_launchers_record_splits_the_downtime_of_a_restart(tmp_path):
  """Attempt 1's last record is at 100 s; its task died at 100.5, the
  launcher saw it at 100.7, had stopped the other tasks at 103.7 and found
  the ports free at 104.0; attempt 2's process started at 104.1. Attempt 3
  was started by hand: the record does not explain the downtime before
  it."""
  record = str(tmp_path / launch_record.FILE_NAME)
  for event in [
      {"event": "start", "t": 49.9, "restart": 0, "tasks": {"worker:0": 11}},
      {"event": "failed", "t": 100.5, "detected": 100.7, "task": "worker:0",
       "code": -9, "tolerated": False},
      {"event": "stopped", "t": 103.7},
      {"event": "waited", "t": 104.0, "ports_free": True},
      {"event": "start", "t": 104.05, "restart": 1, "tasks": {"worker:0": 22}},
      {"event": "exit", "t": 150.2, "code": 1}]:
    files.append_json_line(record, event)
  with open(record, "a", encoding="utf-8") as f:
    f.write('{"event": "sto')  # A crash mid-write: left out.
  events = launch_record.read(record)
  assert len(events) == 6
  attempts = [_attempt(50.0, 100.0, 11), _attempt(104.1, 150.0, 22),
              _attempt(170.0, 200.0, 33)]
  totals = goodput.totals(attempts, events)
  assert {p: totals[f"downtime_{p}"] for p in goodput.DOWNTIME} == (
      pytest.approx({"unrecorded": 0.5, "detect": 0.2, "stop": 3.0,
                     "wait": 0.3, "restart": 0.1, "other": 20.0}))
  assert totals["downtime"] == pytest.approx(24.1)
  assert totals["wall"] == pytest.approx(200.0 - 50.0)
  assert launch_record.failure(events, 104.1, 22) == (
      "worker:0, killed by signal 9")
  assert launch_record.failure(events, 170.0, 33) is None
  # A run not launched: the same downtime, in no parts.
  plain = goodput.totals(attempts)
  assert plain["downtime"] == pytest.approx(24.1)
  assert not [k for k in plain if k.startswith("downtime_")]
  # The run's own totals read the launcher's record where it lies.
  recorder = goodput.Recorder(None, _Clock(170.0), launches=record)
  recorder.earlier = attempts[:2]
  assert recorder.totals()["downtime_stop"] == pytest.approx(3.0)
  with open(record, "a", encoding="utf-8") as f:
    f.write("\n")  # Now a complete line that is not an event.
  with pytest.raises(launch_record.CorruptRecord, match="line 7"):
    launch_record.read(record)
  # A run goes on without (a warning): its downtime unsplit.
  assert "downtime_stop" not in recorder.totals()


def test_the_phases_with_input_waits_add_up_to_the_wall_time(tmp_path,
                                                             monkeypatch):
  now = [10.0]
  monkeypatch.setattr(goodput.time, "time", lambda: now[0])
  recorder = goodput.Recorder(str(tmp_path / goodput.GOODPUT_FILE),
                              _Clock(0.0))
  for start, seconds, waited in ((0, 3.0, 1.0), (5, 2.0, 0.5),
                                 (10, 2.0, 0.5)):
    now[0] += seconds
    recorder.loop(start, start + 5, seconds, waited)
  [attempt] = goodput.read(recorder.path)
  phases = attempt["phases"]
  assert phases["input"] == pytest.approx(2.0)
  # The steady loops' 1.5 s per 5 steps: the first loop's other 0.5 s traced.
  assert phases["productive"] == pytest.approx(4.5)
  assert phases["trace"] == pytest.approx(0.5)
  assert sum(phases.values()) == pytest.approx(now[0])


def test_a_step_on_one_thread_is_not_counted_as_its_input_wait(tmp_path):
  """With one inter-op thread (a worker pinned to one core), the batch's
  second timestamp used to queue behind the step's own ops, so the step's
  whole compute was counted as `input`: 27x the productive time here. The
  step now starts only after that timestamp. The input is in memory and
  prefetched, so its real wait is a small part of the steps' time."""
  workdir = tmp_path / "run"
  result = run_tool("experiments.train", "--dataset=pysource",
                    "--model=transformer", "--seq_len=64", "--num_layers=1",
                    "--d_model=64", "--num_heads=2", "--global_batch_size=8",
                    "--num_devices=1", "--train_steps=100", "--log_every=50",
                    "--eval_every=100", "--inter_op_threads=1",
                    "--intra_op_threads=1", f"--workdir={workdir}")
  assert result.returncode == 0, result.stderr[-3000:]
  with open(workdir / "summary.json", encoding="utf-8") as f:
    written = json.load(f)
  assert 0 <= written["goodput_input_s"] < written["goodput_productive_s"] / 4


def test_async_workers_waits_for_input_are_timed(small_config, monkeypatch):
  start_input = Worker.start_input

  def slow_start(worker, step):
    start_input(worker, step)
    # pylint: disable-next=protected-access
    worker._iterator = _Late(worker._iterator)

  monkeypatch.setattr(Worker, "start_input", slow_start)
  trainer = make_trainer(small_config(mode="async", async_workers=1))
  try:
    t0 = time.perf_counter()
    trainer.train(6)
    seconds = time.perf_counter() - t0
  finally:
    trainer.close()
  # Each update waited for one batch (the first may come before the call).
  assert 5 * INPUT_DELAY_S <= trainer.input_wait_s <= seconds


class _Late:
  """An iterator whose every element comes `INPUT_DELAY_S` late."""

  def __init__(self, iterator):
    self._iterator = iterator
    self.element_spec = iterator.element_spec

  def __next__(self):
    time.sleep(INPUT_DELAY_S)
    return next(self._iterator)


def _native_time(line: str) -> float:
  """The wall time of a TensorFlow native log line: `I0000 00:00:<epoch>`
  before absl's logging is initialised, else `IMMDD HH:MM:SS.micros`."""
  month, day, hours, minutes, seconds = re.match(
      r"[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d+\.\d+)", line).groups()
  if month == "00":
    return float(seconds)
  moment = datetime.datetime(datetime.date.today().year, int(month),
                             int(day), int(hours), int(minutes))
  return moment.timestamp() + float(seconds)


def test_xla_compilation_is_start_up_and_its_line_says_how_long(tmp_path):
  """With --jit_compile XLA compiles when the traced loop first runs:
  TensorFlow's own line about it is stamped between the attempt's start-up
  record and its first loop's, so the first loop's excess, the `trace`
  phase, holds it; the start-up line says how long it took."""
  workdir = tmp_path / "run"
  result = run_tool("experiments.train", "--dataset=synthetic",
                    "--model=mlp", "--num_devices=1", "--train_steps=6",
                    "--log_every=3", "--eval_every=6", "--jit_compile",
                    "--verbosity=2", f"--workdir={workdir}")
  assert result.returncode == 0, result.stderr[-3000:]
  [compiled] = [_native_time(line) for line in result.stderr.splitlines()
                if "Compiled cluster using XLA!" in line]
  with open(workdir / goodput.GOODPUT_FILE, encoding="utf-8") as f:
    lines = [json.loads(line) for line in f]
  assert [line["step"] for line in lines[:2]] == [0, 1]
  assert lines[0]["t"] < compiled < lines[1]["t"]
  [said] = [m for m in map(STARTUP_LINE.search, result.stderr.splitlines())
            if m]
  assert said.group(7) == "tracing and XLA compilation"
  trace = goodput.read(str(workdir / goodput.GOODPUT_FILE))[0]["phases"][
      "trace"]
  assert float(said.group(6)) == pytest.approx(trace, abs=0.1)
