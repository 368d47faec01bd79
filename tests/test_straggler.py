"""The straggler knob (dist_loop/parallel/straggler.py): parsing, bounds, delay."""

import threading
import time

import pytest

from dist_loop.core.errors import UserError
from dist_loop.parallel import straggler


def test_parse_reads_worker_and_factor():
  assert straggler.parse("1:3") == straggler.Straggler(1, 3.0)
  assert straggler.parse("0:1") == straggler.Straggler(0, 1.0)
  assert straggler.parse("2:100") == straggler.Straggler(2, 100.0)
  assert straggler.parse(None) is None and straggler.parse("") is None


@pytest.mark.parametrize("spec", [
    "1", "1:", ":3", "a:3", "1:x", "-1:3", "1:0.5", "1:nan", "1:inf",
    "0:1e300", "0:100.001"])
def test_parse_refuses_bad_specs_naming_the_form(spec):
  with pytest.raises(UserError, match=r"must be WORKER:FACTOR, a worker "
                     r"index and a slow-down factor from 1 to 100"):
    straggler.parse(spec)


def test_check_names_the_valid_worker_range():
  straggler.check("1:3", 2, "async workers")
  straggler.check(None, 1, "async workers")
  with pytest.raises(UserError, match=r"names worker 2, but the run has 2 "
                     r"async workers \(0..1\); use --straggler=1:3$"):
    straggler.check("2:3", 2, "async workers")


def test_only_the_straggler_sleeps_factor_minus_one_times_its_compute():
  slow = straggler.Straggler(1, 3.0)
  assert slow.delay(1, 0.5) == 1.0
  assert slow.delay(0, 0.5) == 0.0
  assert slow.delay(1, -0.1) == 0.0  # A clock that went backwards.
  assert straggler.Straggler(0, straggler.MAX_FACTOR).delay(0, 2.0) == 198.0


def _seconds(fn, *args):
  start = time.monotonic()
  fn(*args)
  return time.monotonic() - start


def test_sleep_waits_its_seconds_unless_stopped():
  assert _seconds(straggler.sleep, 0.2) >= 0.19
  assert _seconds(straggler.sleep, 0.2, threading.Event()) >= 0.19
  # Not positive: no wait, and no error from time.sleep's negative bound.
  assert _seconds(straggler.sleep, 0.0) < 1.0
  assert _seconds(straggler.sleep, -5.0) < 1.0
  stopped = threading.Event()
  stopped.set()
  assert _seconds(straggler.sleep, 3600.0, stopped) < 1.0
  # A stop set while it sleeps ends the sleep.
  stop = threading.Event()
  timer = threading.Timer(0.2, stop.set)
  timer.start()
  try:
    assert 0.19 <= _seconds(straggler.sleep, 3600.0, stop) < 10.0
  finally:
    timer.cancel()
