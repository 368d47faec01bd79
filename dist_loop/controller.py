"""The outer loop: train to the next event, run the actions, stop cleanly.

The controller never computes a step: it asks the mode's `Trainer` for
`train(n)` and runs the actions (`dist_loop/actions.py`: log line,
evaluation, checkpoints, histograms, profile) on their schedule. Each inner
loop runs up to the next step an action asks for (at most `steps_per_loop`
steps), so events land on exact steps without retracing: the step count
reaches the traced loop as a tensor. The controller also owns what must be
the same in every mode: the check that the step counter advanced, the
non-finite policy, SIGTERM, and summary.json. In a run whose workers train
in lockstep, a SIGTERM to any of them stops all of them at the same step
(`dist_loop/preemption.py`).

Of a trainer it uses `train`, `step`, `scope`, `on_restore`,
`examples_per_step`, `devices` and, if the trainer subclasses `Reporting`,
`summary()`; the actions add `optimizer.learning_rate`, `report()`,
`model`, `dataset` and `on_master`.
"""

import os
import signal
import threading
import time
from typing import Dict, List, Optional, Sequence

from absl import logging

from dist_loop.actions import Action, Loop
from dist_loop.config import Config
from dist_loop.errors import Interrupted, NonFiniteError, UserError
from dist_loop.files import atomic_write_json
from dist_loop.memory import peak_memory_mb
from dist_loop.modes.base import Reporting

SIGTERM_EXIT_CODE = Interrupted.EXIT_CODES["SIGTERM"]


class Controller:
  """Runs a `Trainer` to `config.train_steps`, with the run's actions.

  Args:
    config: the run's configuration (schedule and fault policies).
    trainer: the mode's `Trainer`.
    checkpointer: has `save(step)` and `restore(scope) -> path or None`
      (`checkpoints.Checkpointer`); used on SIGTERM, Ctrl-C and rollback.
    summaries: `Summaries` (the non-finite scalars, and the final flush).
    actions: in the order they run after a loop (`actions.standard`).
    summary_path: where to write summary.json, or None (not the chief).
    metric_names: the task's metrics; summary.json gets `train_<name>`.
    agreement: a multi-worker run's `preemption.Agreement`, or None.
  """

  def __init__(self, config: Config, trainer, checkpointer, summaries,
               actions: Sequence[Action], summary_path: Optional[str] = None,
               metric_names: Sequence[str] = ("loss", "accuracy"),
               agreement=None):
    self.config = config
    self.trainer = trainer
    self.checkpointer = checkpointer
    self.summaries = summaries
    self.actions: List[Action] = list(actions)
    self.summary_path = summary_path
    self.metric_names = tuple(metric_names)
    self.agreement = agreement
    self.latest: Dict[str, float] = {}  # What the actions last returned.
    self.skipped = 0
    self.rollbacks = 0
    self._ran_at: Dict[int, int] = {}  # id(action) -> last step it ran.
    self._totals = {"all": [0, 0, 0.0], "steady": [0, 0, 0.0]}
    self._preempted = False
    self._saved_on_sigterm = False
    self._exit = os._exit  # pylint: disable=protected-access

  def run(self) -> Dict[str, object]:
    """Trains to the last step, runs the final actions, writes the summary.

    Raises:
      NonFiniteError: with --nonfinite=raise (or skip, if the mode raised).
      UserError: rollbacks exhausted, or nothing to roll back to.
      Interrupted: SIGTERM or Ctrl-C; a checkpoint of the step was saved.
    """
    cfg = self.config
    start_time = time.time()
    step = self._step()
    if step >= cfg.train_steps:
      logging.info("Already trained to step %d of %d; nothing to train.",
                   step, cfg.train_steps)
    else:
      for action in self.actions:
        action.start(step)
    previous_handler = self._install_sigterm_handler()
    try:
      first_loop = True
      while step < cfg.train_steps:
        target = self._next_stop(step)
        try:
          loop = self._train(step, target)
        except NonFiniteError as e:
          step = self._on_nonfinite(e)
          continue
        self._count(loop, steady=not first_loop)  # The first one traces.
        first_loop = False
        step = target
        for action in self.actions:
          action.observe(loop)
        for action in self.actions:
          if action.due(step) or (step == cfg.train_steps and action.at_end):
            self._run_action(action, step)
        if self._stop_agreed():
          self.checkpointer.save(step)
          self._saved_on_sigterm = True
          raise Interrupted(step, "SIGTERM")
    except KeyboardInterrupt:
      step = self._step()
      self.checkpointer.save(step)
      raise Interrupted(step, "SIGINT") from None
    finally:
      if previous_handler is not None:
        signal.signal(signal.SIGTERM, previous_handler)
      self.summaries.flush()
    # The final actions that did not run at this step yet: all of them if
    # there was nothing to train.
    for action in self.actions:
      if action.at_end and self._ran_at.get(id(action)) != step:
        self._run_action(action, step)
    return self._write_summary(step, time.time() - start_time)

  # -- the schedule --

  def _next_stop(self, step: int) -> int:
    """The next step at which the controller has something to do."""
    stops = [step + self.config.steps_per_loop, self.config.train_steps]
    stops += [action.stops(step) for action in self.actions]
    return min(s for s in stops if s is not None)

  def _train(self, step: int, target: int) -> Loop:
    """One inner loop from `step` to `target`, checked."""
    t0 = time.perf_counter()
    metrics = dict(self.trainer.train(target - step))
    seconds = time.perf_counter() - t0
    skipped = int(metrics.pop("train/skipped_steps", 0))
    metrics.pop("train/skipped_steps_at_end", None)
    new_step = self._step()
    if new_step != target:
      raise RuntimeError(f"the step counter is at {new_step} after training "
                         f"from {step} to {target}: the mode's train(n) must "
                         "advance it by exactly n")
    self.skipped += skipped
    return Loop(step, target, metrics, skipped,
                (target - step) * self.trainer.examples_per_step, seconds)

  def _run_action(self, action: Action, step: int) -> None:
    self._ran_at[id(action)] = step
    result = action(step)
    if result:
      self.latest.update(result)

  def _count(self, loop: Loop, steady: bool) -> None:
    for key in ("all", "steady") if steady else ("all",):
      totals = self._totals[key]
      totals[0] += loop.examples
      totals[1] += loop.updates
      totals[2] += loop.seconds

  def _step(self) -> int:
    return int(self.trainer.step.numpy())

  # -- faults --

  def _on_nonfinite(self, error: NonFiniteError) -> int:
    """--nonfinite=rollback: back to the last checkpoint; else re-raise.
    Returns the step to go on from."""
    cfg = self.config
    what = ("non-finite loss or gradients" if not cfg.max_loss else
            f"a loss above --max_loss={cfg.max_loss:g}, or non-finite values,")
    if cfg.max_loss:  # The mode does not say which of the two it was.
      error.args = (f"{what} at step {error.step}; lower --learning_rate, or "
                    "check the input data",)
    self.summaries.scalars(error.step, {"nonfinite/at_step": error.step})
    if cfg.nonfinite != "rollback":
      raise error
    self.rollbacks += 1
    self.summaries.scalars(error.step, {"nonfinite/rollbacks": self.rollbacks})
    if self.rollbacks > cfg.max_rollbacks:
      raise UserError(
          f"{what} at step {error.step} after {cfg.max_rollbacks} rollbacks "
          "(--max_rollbacks); lower --learning_rate, or check the input data"
          ) from None
    path = self.checkpointer.restore(self.trainer.scope())
    if path is None:
      raise UserError(f"{what} at step {error.step} and no checkpoint to "
                      "roll back to yet; lower --checkpoint_every or "
                      "--learning_rate") from None
    self.trainer.on_restore()
    logging.warning("%s at step %d: rolled back to %s (rollback %d of at "
                    "most %d).", what[0].upper() + what[1:].rstrip(","),
                    error.step, path, self.rollbacks, cfg.max_rollbacks)
    return self._step()

  def _install_sigterm_handler(self):
    """SIGTERM (preemption) asks for a checkpoint at the end of the current
    inner loop and an exit; a watchdog ends the process with exit code 143
    if it is still alive --grace_period_s after the signal. Returns the
    previous handler (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
      return None

    def on_sigterm(signum, frame):
      del signum, frame
      if self._preempted:
        return
      self._preempted = True
      logging.warning("SIGTERM: saving a checkpoint and exiting within %gs.",
                      self.config.grace_period_s)
      watchdog = threading.Timer(self.config.grace_period_s, self._grace_over)
      watchdog.daemon = True
      watchdog.start()

    return signal.signal(signal.SIGTERM, on_sigterm)

  def _stop_agreed(self) -> bool:
    """Whether this process, or any worker of a multi-worker run, got
    SIGTERM; every worker calls it after every loop, so all agree."""
    if self.agreement is None:
      return self._preempted
    stop = self.agreement.any(self._preempted)
    if stop and not self._preempted:
      logging.warning("Another worker got SIGTERM: saving a checkpoint of "
                      "step %d with every worker, then exiting.",
                      self._step())
    return stop

  def _grace_over(self) -> None:
    if self._saved_on_sigterm:
      logging.error("Still running --grace_period_s=%g after SIGTERM; "
                    "exiting. The checkpoint was saved.",
                    self.config.grace_period_s)
    else:
      logging.error("No checkpoint within --grace_period_s=%g after SIGTERM;"
                    " exiting. The last saved checkpoint is intact.",
                    self.config.grace_period_s)
    self._exit(SIGTERM_EXIT_CODE)

  # -- the end --

  def _write_summary(self, step: int, wall_time: float) -> Dict[str, object]:
    """summary.json: the final metrics, the steady-state rates (the first
    loop, which traces, excluded when there were others), the faults."""
    examples, updates, seconds = (self._totals["steady"]
                                  if self._totals["steady"][2]
                                  else self._totals["all"])
    seconds = max(seconds, 1e-9)
    summary = {
        "final_step": step,
        "eval_loss": self.latest.get("eval/loss"),
        "eval_accuracy": self.latest.get("eval/accuracy"),
        **{k.replace("/", "_", 1): v for k, v in self.latest.items()
           if k.startswith("eval/")},
        **{f"train_{name}": self.latest.get(f"train/{name}")
           for name in ("loss", "accuracy") + self.metric_names},
        "examples_per_sec": examples / seconds,
        "updates_per_sec": updates / seconds,
        "wall_time_s": wall_time,
        "mode": self.config.mode,
        "num_devices": self.config.num_devices,
        "skipped_steps": self.skipped,
        "rollbacks": self.rollbacks,
    }
    if isinstance(self.trainer, Reporting):
      summary.update(self.trainer.summary())
    summary.update({k.replace("memory/", "memory_"): v
                    for k, v in peak_memory_mb(self.trainer.devices).items()})
    if self.summary_path:
      try:
        atomic_write_json(self.summary_path, summary)
      except OSError as e:
        raise UserError(
            f"cannot write {self.summary_path} ({e.strerror}); the run is "
            f"complete and its checkpoint of step {step} is saved. Make room "
            "for it and rerun the same command to write it") from None
    self.summaries.final(summary)
    self.summaries.flush()
    return summary
