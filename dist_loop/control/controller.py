"""The outer loop: train to the next step an action asks for, check that the
step counter got there, run the actions.

The controller never computes a step: it asks the mode's `Trainer` for
`train(n)` and runs the actions (`dist_loop/control/actions/`: log line,
evaluation, checkpoints, histograms, profile, summary.json) on their schedule. Each
inner loop runs up to the next step any action asks for (at most
`steps_per_loop` steps), so events land on exact steps without retracing:
the step count reaches the traced loop as a tensor.

Two collaborators decide what a stop means, and the controller only asks
them at the right moments: `recovery` (`dist_loop/control/recovery.py`) when a
loop raises `NonFiniteError` and after every loop, and `stop`
(`preemption.Sigterm`) after every loop. A stop by SIGTERM or Ctrl-C gives
every action its `interrupted(step)` (the checkpoint action saves) and
raises `Interrupted`.

A third, `goodput` (`dist_loop/runtime/goodput.py`'s `Recorder`), is told the
time of every inner loop (and of its input waits, where the trainer measures
them), restore and action (by the action's `phase`), so the workdir's record
says where the run's time went.

Of a trainer it uses `train`, `step`, `examples_per_step` and
`input_wait_s`.
"""

import contextlib
import time
from typing import Dict, List, Sequence

from absl import logging

from dist_loop.control.actions import Action, Loop
from dist_loop.core.errors import Interrupted, NonFiniteError


class Controller:
  """Runs a `Trainer` to `train_steps`, with the run's actions.

  Args:
    trainer: the mode's `Trainer`.
    actions: in the order they run after a loop (`actions.standard`).
    train_steps: the last step.
    steps_per_loop: the most steps of one inner loop.
    recovery: has `recover(NonFiniteError)` (raises, or restores a
      checkpoint to go on from) and `observe(Loop)` (may raise); None: a
      `NonFiniteError` ends the run.
    stop: a `preemption.Sigterm` (a context manager whose `requested()` says
      whether to stop after this loop), or None.
    goodput: a `goodput.Recorder` (has `loop`, `restore`, `add`), or None.
  """

  def __init__(self, trainer, actions: Sequence[Action], *, train_steps: int,
               steps_per_loop: int, recovery=None, stop=None,
               goodput=None):
    self.trainer = trainer
    self.actions: List[Action] = list(actions)
    self.train_steps = train_steps
    self.steps_per_loop = steps_per_loop
    self.recovery = recovery
    self.stop = stop
    self.goodput = goodput
    self._ran_at: Dict[int, int] = {}  # id(action) -> last step it ran.

  def run(self) -> int:
    """Trains to the last step and runs the final actions.

    Returns:
      The final step.

    Raises:
      NonFiniteError, UserError: from `recovery` (or from an action).
      Interrupted: SIGTERM or Ctrl-C; `saved` says whether a checkpoint of
        its step was saved.
    """
    step = self._step()
    if step >= self.train_steps:
      logging.info("Already trained to step %d of %d; nothing to train.",
                   step, self.train_steps)
    else:
      for action in self.actions:
        action.start(step)
    with self.stop or contextlib.nullcontext():
      try:
        step = self._loops(step)
        # The final actions that did not run at this step yet: all of them
        # if there was nothing to train.
        for action in self.actions:
          if action.at_end and self._ran_at.get(id(action)) != step:
            self._run_action(action, step)
      except KeyboardInterrupt:
        step = self._step()
        raise Interrupted(step, "SIGINT", saved=self._interrupt(step)
                          ) from None
    return step

  def _loops(self, step: int) -> int:
    while step < self.train_steps:
      target = self._next_stop(step)
      t0 = time.perf_counter()
      try:
        loop = self._train(step, target)
      except NonFiniteError as e:
        if self.recovery is None:
          raise
        if self.goodput is not None:  # Trained to the bad step: lost work.
          self.goodput.loop(step, max(int(e.step), step),
                            time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.recovery.recover(e)  # Raises, or rolled back.
        step = self._step()
        if self.goodput is not None:
          self.goodput.restore(step, time.perf_counter() - t0)
        continue
      step = target
      if self.recovery is not None:
        self.recovery.observe(loop)
      for action in self.actions:
        action.observe(loop)
      for action in self.actions:
        if action.due(step) or (step == self.train_steps and action.at_end):
          self._run_action(action, step)
      # At the last step the run is complete: nothing to stop.
      if (step < self.train_steps and self.stop is not None
          and self.stop.requested()):
        saved = self._interrupt(step)
        if saved:
          self.stop.saved()
        raise Interrupted(step, "SIGTERM", saved=saved)
    return step

  def _next_stop(self, step: int) -> int:
    """The next step at which the controller has something to do."""
    stops = [step + self.steps_per_loop, self.train_steps]
    stops += [action.stops(step) for action in self.actions]
    return min(s for s in stops if s is not None)

  def _train(self, step: int, target: int) -> Loop:
    """One inner loop from `step` to `target`, checked."""
    t0 = time.perf_counter()
    metrics = dict(self.trainer.train(target - step))
    seconds = time.perf_counter() - t0
    skipped = int(metrics.pop("train/skipped_steps", 0))
    skipped_at_end = int(metrics.pop("train/skipped_steps_at_end", skipped))
    new_step = self._step()
    if new_step != target:
      raise RuntimeError(f"the step counter is at {new_step} after training "
                         f"from {step} to {target}: the mode's train(n) must "
                         "advance it by exactly n")
    if self.goodput is not None:
      self.goodput.loop(step, target, seconds,
                        getattr(self.trainer, "input_wait_s", None) or 0.0)
    return Loop(step, target, metrics, skipped,
                (target - step) * self.trainer.examples_per_step, seconds,
                skipped_at_end)

  def _run_action(self, action: Action, step: int) -> None:
    self._ran_at[id(action)] = step
    with self._timed(action):
      action(step)

  @contextlib.contextmanager
  def _timed(self, action: Action):
    """Adds the time of `action`'s work to its goodput phase."""
    t0 = time.perf_counter()
    try:
      yield
    finally:
      if self.goodput is not None:
        self.goodput.add(action.phase, time.perf_counter() - t0)

  def _interrupt(self, step: int) -> bool:
    """Every action's `interrupted(step)`; False if a second Ctrl-C cut
    that short (the last saved checkpoint stays the newest)."""
    try:
      for action in self.actions:
        with self._timed(action):
          action.interrupted(step)
    except KeyboardInterrupt:
      return False
    return True

  def _step(self) -> int:
    return int(self.trainer.step.numpy())
