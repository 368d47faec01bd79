"""Preemption, in this process: SIGTERM as a stop request with its
grace-period watchdog (`preemption.Sigterm`), the multi-worker agreement's
collective, and the controller stopping at the step a peer's SIGTERM was
agreed on.

Across processes, a SIGTERM to one worker of a two-worker cluster making
both save the same step is part of the multi-worker story
(tests/test_multiworker.py), which already runs that cluster.
"""

import os
import signal
import threading

import pytest

from controller_fakes import run as _run
from dist_loop.core.errors import Interrupted
from dist_loop.runtime import preemption, strategy
from dist_loop.runtime.cluster import Cluster


def _events(log, kind):
  return [e[1] for e in log if e[0] == kind]


def _sigterm_at(step):
  def on_train(start, n):
    if start < step <= start + n:
      os.kill(os.getpid(), signal.SIGTERM)
  return on_train


class Exits:
  """The watchdog's exit, which would end pytest: recorded instead."""

  def __init__(self):
    self.codes = []
    self.event = threading.Event()

  def __call__(self, code):
    self.codes.append(code)
    self.event.set()


def _stop(grace_period_s=30.0, agreement=None):
  exits = Exits()
  return preemption.Sigterm(grace_period_s, agreement, exit_fn=exits), exits


def test_sigterm_saves_at_the_end_of_the_loop_and_exits_143(tmp_path):
  before = signal.getsignal(signal.SIGTERM)
  stop, exits = _stop()
  run = _run(tmp_path, on_train=_sigterm_at(7), checkpoint_every=100,
             stop=stop)
  assert isinstance(run.result, Interrupted) and run.result.exit_code == 143
  assert run.result.step == 10 and run.saved == [10]
  assert signal.getsignal(signal.SIGTERM) is before
  assert not (tmp_path / "summary.json").exists()
  # The watchdog still bounds what follows (the teardown); not fired yet.
  assert stop.watchdog.is_alive() and not exits.codes
  stop.watchdog.cancel()


def test_the_watchdog_exits_143_after_the_grace_period_if_the_loop_hangs(
    tmp_path):
  stop, exits = _stop(grace_period_s=0.2)

  def hang(start, n):
    _sigterm_at(7)(start, n)
    if start < 7 <= start + n:  # Waits for the watchdog, as a hung loop.
      assert exits.event.wait(timeout=30), "the watchdog did not fire"

  run = _run(tmp_path, on_train=hang, stop=stop)
  assert exits.codes == [143]
  assert isinstance(run.result, Interrupted) and run.saved == [10]


@pytest.mark.parametrize("grace", [float("inf"), 1e12])
def test_a_grace_period_no_timer_can_wait_sets_no_watchdog(tmp_path, grace):
  failures = []
  previous_hook = threading.excepthook
  threading.excepthook = failures.append  # A thread's OverflowError.
  try:
    stop, exits = _stop(grace_period_s=grace)
    run = _run(tmp_path, on_train=_sigterm_at(7), stop=stop)
  finally:
    threading.excepthook = previous_hook
  assert isinstance(run.result, Interrupted) and run.result.exit_code == 143
  assert run.saved == [10] and stop.watchdog is None
  assert not failures and not exits.codes


def test_watchdog_seconds():
  assert preemption.watchdog_seconds(30.0) == 30.0
  assert preemption.watchdog_seconds(threading.TIMEOUT_MAX) == (
      threading.TIMEOUT_MAX)
  assert preemption.watchdog_seconds(threading.TIMEOUT_MAX * 2) is None
  assert preemption.watchdog_seconds(float("inf")) is None


def test_off_the_main_thread_no_handler_is_installed():
  before = signal.getsignal(signal.SIGTERM)
  seen = []

  def enter():
    with preemption.Sigterm(1.0):
      seen.append(signal.getsignal(signal.SIGTERM))

  thread = threading.Thread(target=enter)
  thread.start()
  thread.join(timeout=30)
  assert seen == [before]


# -- the multi-worker agreement --


class PeerStops:
  """A peer got SIGTERM during the loop that reaches step `at`."""

  def __init__(self, trainer, at):
    self.trainer, self.at = trainer, at
    self.calls = []  # (step, this worker's flag)

  def any(self, local):
    self.calls.append((self.trainer.value, local))
    return local or self.trainer.value >= self.at


def _run_with_agreement(tmp_path, at, **kwargs):
  made = []

  def stop_for(trainer):
    made.append(_stop(agreement=PeerStops(trainer, at))[0])
    return made[0]

  run = _run(tmp_path, stop=stop_for, train_steps=30, steps_per_loop=5,
             log_every=5, eval_every=100, checkpoint_every=100, **kwargs)
  if made[0].watchdog is not None:
    made[0].watchdog.cancel()
  return run, made[0].agreement


def test_a_peers_sigterm_saves_the_agreed_step_and_exits_143(tmp_path):
  run, agreement = _run_with_agreement(tmp_path, at=10)
  assert isinstance(run.result, Interrupted)
  assert (run.result.step, run.result.exit_code) == (10, 143)
  assert run.saved == [10]
  # Asked after every loop, with this worker's own flag (no SIGTERM here).
  assert agreement.calls == [(1, False), (5, False), (10, False)]


def test_its_own_sigterm_goes_into_the_agreement(tmp_path):
  run, agreement = _run_with_agreement(
      tmp_path, at=10 ** 6, on_train=lambda start, n: (
          os.kill(os.getpid(), signal.SIGTERM) if start == 10 else None))
  assert isinstance(run.result, Interrupted) and run.result.step == 15
  assert agreement.calls[-1] == (15, True) and run.saved == [15]


def test_no_agreement_without_several_training_processes():
  assert preemption.Agreement.for_run(None, Cluster()) is None
  ps = Cluster({"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]},
               "chief", 0)
  assert preemption.Agreement.for_run(None, ps) is None


def test_the_agreement_sums_a_flag_over_every_replica():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
  agreement = preemption.Agreement(strategy.mirrored(devices))
  assert agreement.any(True) and not agreement.any(False)


# -- Ctrl-C outside the training loop (the loop's own: test_controller.py) --


def test_ctrl_c_at_start_up_is_one_clean_sigint(small_config, monkeypatch):
  from dist_loop import data, train  # pylint: disable=g-import-not-at-top

  def interrupted(config, image_size):
    del config, image_size
    raise KeyboardInterrupt

  monkeypatch.setattr(data, "load", interrupted)
  cfg = small_config()
  with pytest.raises(Interrupted) as e:
    train.run(cfg)
  assert (e.value.step, e.value.exit_code) == (None, 130)
  assert str(e.value).startswith("SIGINT outside the training loop; no "
                                 "trained step was lost.")
  assert not os.path.exists(os.path.join(cfg.workdir, "lock"))


def test_ctrl_c_while_shutting_down_keeps_the_error_that_ended_the_run(
    small_config, monkeypatch):
  from dist_loop import train  # pylint: disable=g-import-not-at-top
  from dist_loop.core.errors import UserError  # pylint: disable=g-import-not-at-top
  from dist_loop.parallel.modes.sync.trainer import SyncTrainer  # pylint: disable=g-import-not-at-top
  from dist_loop.runtime import checkpoints  # pylint: disable=g-import-not-at-top

  def unreadable(self, scope):
    raise UserError("no readable checkpoint")

  def close(self):
    raise KeyboardInterrupt

  monkeypatch.setattr(checkpoints.Checkpointer, "restore", unreadable)
  monkeypatch.setattr(SyncTrainer, "close", close)
  with pytest.raises(UserError, match="^no readable checkpoint$"):
    train.run(small_config())
