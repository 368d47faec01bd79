"""The controller's schedule, with a fake trainer, evaluator and checkpointer
(tests/controller_fakes.py): inner loops that end where an action asks, the
step check, the final actions, and when it hands over to its collaborators
(the non-finite policy, the stop request), without training.

The collaborators themselves are tested in test_recovery.py and
test_preemption.py, the actions in test_actions.py.
"""

import pytest

from controller_fakes import FakeTrainer
from controller_fakes import run as _run
from dist_loop.control.actions import Action
from dist_loop.control.controller import Controller
from dist_loop.core.errors import Interrupted, NonFiniteError, UserError


def _events(log, kind):
  return [e[1] for e in log if e[0] == kind]


def _ends(log):
  return [e[1] + e[2] for e in log if e[0] == "train"]


class Recorder(Action):
  """Logs what the controller asks of it."""

  def __init__(self, log, every=0, at_end=False, name="recorder"):
    self.every, self.at_end, self.log, self.name = every, at_end, log, name

  def start(self, step):
    self.log.append((f"{self.name}.start", step))

  def observe(self, loop):
    self.log.append((f"{self.name}.observe", loop.start, loop.end))

  def interrupted(self, step):
    self.log.append((f"{self.name}.interrupted", step))

  def __call__(self, step):
    self.log.append((self.name, step))


def _controller(log, actions, train_steps=10, steps_per_loop=4, start=0,
                **kwargs):
  trainer = FakeTrainer(log, **{k: kwargs.pop(k) for k in
                                ("nan", "lag", "on_train") if k in kwargs})
  trainer.value = start
  return Controller(trainer, actions, train_steps=train_steps,
                    steps_per_loop=steps_per_loop, **kwargs)


# -- the schedule --


def test_events_land_on_exact_steps(tmp_path):
  run = _run(tmp_path, train_steps=23, log_every=5, eval_every=7,
             checkpoint_every=10, profile_steps="12,14")
  # Each inner loop stops at the next event (or after steps_per_loop); the
  # first one after one step (the log's first loss).
  assert _ends(run.log) == [1, 5, 7, 10, 11, 14, 15, 20, 21, 23]
  assert sorted(run.scalar["train/loss"]) == [5, 10, 15, 20, 23]
  assert _events(run.log, "eval") == [7, 14, 21, 23]
  assert _events(run.log, "save") == [10, 20, 23]
  # The graph of the first loop; a profile of exactly steps 12..14.
  assert run.log[0] == ("trace_begin",) and run.log[2] == ("trace_end", 1)
  begin = run.log.index(("profile_begin",))
  end = run.log.index(("profile_end",))
  assert run.log[begin + 1] == run.log[end - 1] == ("train", 11, 3)


def test_steps_per_loop_bounds_a_loop_and_actions_run_in_order():
  log = []
  first = Recorder(log, every=6, name="a")
  second = Recorder(log, every=3, at_end=True, name="b")
  _controller(log, [first, second]).run()
  assert _ends(log) == [3, 6, 9, 10]
  assert [e for e in log if e[0] in ("a", "b")] == [
      ("b", 3), ("a", 6), ("b", 6), ("b", 9), ("b", 10)]
  # Every action sees every loop before any action runs.
  at6 = log.index(("a", 6))
  assert log[at6 - 2:at6] == [("a.observe", 3, 6), ("b.observe", 3, 6)]
  assert log[0] == ("a.start", 0) and log[1] == ("b.start", 0)


def test_an_at_end_action_due_at_the_last_step_runs_once():
  log = []
  _controller(log, [Recorder(log, every=5, at_end=True)]).run()
  assert [e for e in log if e[0] == "recorder"] == [("recorder", 5),
                                                    ("recorder", 10)]


def test_a_finished_run_only_runs_the_final_actions_once():
  log = []
  step = _controller(log, [Recorder(log, every=5, at_end=True),
                           Recorder(log, every=5, name="periodic")],
                     start=10).run()
  assert step == 10
  assert log == [("recorder", 10)]  # No start, no training, no periodic.


def test_the_step_counter_must_advance_by_n():
  log = []
  with pytest.raises(RuntimeError, match="step counter is at 3 after "
                     "training from 0 to 4"):
    _controller(log, [], lag=1).run()


# -- handing over: the non-finite policy --


class FakeRecovery:
  """Rolls back to step `to` once, then raises; logs what it sees."""

  def __init__(self, log, trainer_ref, to=0, fail_on_loop_end=None):
    self.log, self.trainer_ref, self.to = log, trainer_ref, to
    self.fail_on_loop_end = fail_on_loop_end
    self.recovered = []

  def recover(self, error):
    self.recovered.append(error.step)
    if len(self.recovered) > 1:
      raise error
    self.trainer_ref[0].value = self.to

  def observe(self, loop):
    self.log.append(("recovery.observe", loop.end))
    if loop.end == self.fail_on_loop_end:
      raise UserError("stop")


def test_a_nonfinite_step_goes_to_the_recovery_which_may_roll_back():
  log, ref = [], []
  recovery = FakeRecovery(log, ref, to=4)
  controller = _controller(log, [Recorder(log, every=4)], nan=[6],
                           recovery=recovery)
  ref.append(controller.trainer)
  assert controller.run() == 10
  assert recovery.recovered == [6]
  # Failed in the loop from 4, then went on from the step restored.
  assert _ends(log) == [4, 8, 8, 10] and ("train", 4, 4) in log
  assert log.count(("train", 4, 4)) == 2


def test_without_recovery_a_nonfinite_step_ends_the_run():
  with pytest.raises(NonFiniteError) as e:
    _controller([], [], nan=[6]).run()
  assert e.value.step == 6


def test_the_recovery_sees_every_loop_first_and_may_stop_the_run():
  log, ref = [], []
  controller = _controller(log, [Recorder(log, every=4)],
                           recovery=FakeRecovery(log, ref,
                                                 fail_on_loop_end=8))
  with pytest.raises(UserError, match="stop"):
    controller.run()
  assert log.index(("recovery.observe", 4)) < log.index(
      ("recorder.observe", 0, 4))
  assert ("recorder", 8) not in log and _ends(log) == [4, 8]


# -- handing over: stop requests and Ctrl-C --


class FakeStop:
  """A stop request after the loop that ends at `at`."""

  def __init__(self, log, trainer_ref, at):
    self.log, self.trainer_ref, self.at = log, trainer_ref, at
    self.entered = self.exited = self.was_saved = False

  def __enter__(self):
    self.entered = True
    return self

  def __exit__(self, *exc):
    self.exited = True

  def requested(self):
    value = self.trainer_ref[0].value
    self.log.append(("stop?", value))
    return value >= self.at

  def saved(self):
    self.was_saved = True


def test_a_stop_request_interrupts_every_action_then_raises_sigterm():
  log, ref = [], []
  stop = FakeStop(log, ref, at=4)
  controller = _controller(log, [Recorder(log, every=4)], stop=stop)
  ref.append(controller.trainer)
  with pytest.raises(Interrupted) as e:
    controller.run()
  assert (e.value.step, e.value.exit_code, e.value.saved) == (4, 143, True)
  # The loop's actions ran, then the request was read, then the stop.
  assert log[-3:] == [("recorder", 4), ("stop?", 4),
                      ("recorder.interrupted", 4)]
  assert stop.entered and stop.exited and stop.was_saved


def test_a_stop_request_at_the_last_step_is_not_a_stop():
  log, ref = [], []
  stop = FakeStop(log, ref, at=10)
  controller = _controller(log, [Recorder(log, at_end=True)], stop=stop)
  ref.append(controller.trainer)
  assert controller.run() == 10
  assert ("stop?", 10) not in log and ("recorder", 10) in log


def test_ctrl_c_in_a_loop_interrupts_the_actions_and_raises_sigint():
  def interrupt(start, n):
    if start == 4:
      raise KeyboardInterrupt

  log = []
  with pytest.raises(Interrupted) as e:
    _controller(log, [Recorder(log)], on_train=interrupt).run()
  assert (e.value.step, e.value.exit_code, e.value.saved) == (4, 130, True)
  assert log[-1] == ("recorder.interrupted", 4)


class InterruptOnce(Recorder):
  """Ctrl-C while it runs at `step`; and, if `again`, while interrupted."""

  def __init__(self, log, step, again=False, **kwargs):
    super().__init__(log, **kwargs)
    self.step, self.again = step, again

  def __call__(self, step):
    super().__call__(step)
    if step == self.step:
      raise KeyboardInterrupt

  def interrupted(self, step):
    super().interrupted(step)
    if self.again:
      raise KeyboardInterrupt


def test_ctrl_c_in_a_final_action_is_a_clean_sigint():
  log = []
  with pytest.raises(Interrupted) as e:
    _controller(log, [InterruptOnce(log, 10, at_end=True)], start=10).run()
  assert (e.value.step, e.value.exit_code, e.value.saved) == (10, 130, True)


def test_a_second_ctrl_c_while_saving_says_the_step_was_not_saved():
  log = []
  with pytest.raises(Interrupted) as e:
    _controller(log, [InterruptOnce(log, 4, again=True, every=4)]).run()
  assert (e.value.step, e.value.saved) == (4, False)
  assert "before its checkpoint was saved" in str(e.value)

