"""Coordinated preemption, in this process: the agreement's collective, and
the controller stopping at the step a peer's SIGTERM was agreed on.

Across processes, a SIGTERM to one worker of a two-worker cluster making
both save the same step is part of the chaos story (tests/test_chaos.py),
which already runs that cluster.
"""

import os
import signal

from controller_fakes import (FakeCheckpointer, FakeEvaluator, FakeSummaries,
                              FakeTrainer)
from dist_loop import actions, preemption, strategy
from dist_loop.cluster import Cluster
from dist_loop.config import Config
from dist_loop.controller import Controller
from dist_loop.errors import Interrupted


class PeerStops:
  """A peer got SIGTERM during the loop that reaches step `at`."""

  def __init__(self, trainer, at):
    self.trainer, self.at = trainer, at
    self.calls = []  # (step, this worker's flag)

  def any(self, local):
    self.calls.append((self.trainer.value, local))
    return local or self.trainer.value >= self.at


def _controller(tmp_path, agreement_at=None):
  config = Config(workdir=str(tmp_path), train_steps=30, steps_per_loop=5,
                  log_every=5, eval_every=100, checkpoint_every=100)
  log = []
  trainer = FakeTrainer(log)
  checkpointer = FakeCheckpointer(trainer, log)
  summaries = FakeSummaries(log)
  agreement = (PeerStops(trainer, agreement_at) if agreement_at is not None
               else None)
  controller = Controller(
      config, trainer, checkpointer, summaries,
      actions.standard(config, trainer, FakeEvaluator(trainer, log),
                       checkpointer, summaries, task=None),
      agreement=agreement)
  # The SIGTERM watchdog's exit, which would end pytest.
  controller._exit = lambda code: None  # pylint: disable=protected-access
  return controller, checkpointer, agreement


def test_a_peers_sigterm_saves_the_agreed_step_and_exits_143(tmp_path):
  controller, checkpointer, agreement = _controller(tmp_path, agreement_at=10)
  try:
    controller.run()
    raise AssertionError("the run went on after a peer's SIGTERM")
  except Interrupted as e:
    assert (e.step, e.exit_code) == (10, 143)
  assert checkpointer.saved == [10]
  # Asked after every loop, with this worker's own flag (no SIGTERM here).
  assert agreement.calls == [(5, False), (10, False)]


def test_its_own_sigterm_goes_into_the_agreement(tmp_path):
  controller, checkpointer, agreement = _controller(tmp_path,
                                                    agreement_at=10 ** 6)
  trainer = controller.trainer
  trainer.on_train = lambda start, n: (
      os.kill(os.getpid(), signal.SIGTERM) if start == 10 else None)
  try:
    controller.run()
    raise AssertionError("the run went on after SIGTERM")
  except Interrupted as e:
    assert e.step == 15
  assert agreement.calls[-1] == (15, True) and checkpointer.saved == [15]


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
