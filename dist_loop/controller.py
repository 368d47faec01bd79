"""The outer loop: when to train, log, evaluate, checkpoint and stop.

The controller never computes a step; it asks the mode's `Trainer` for
`train(n)` and schedules everything else around it. Each inner loop runs up to
the next event (a log, eval, checkpoint or histogram boundary, at most
`steps_per_loop` steps), so events land on exact steps without retracing: the
step count reaches the traced loop as a tensor.
"""

import datetime
import os
import signal
import threading
import time
from typing import Dict, Optional

import numpy as np
import tensorflow as tf
from absl import logging

from dist_loop.config import Config
from dist_loop import checkpoints
from dist_loop.errors import Interrupted, NonFiniteError, UserError
from dist_loop.evaluation import Evaluator, probe_gradients
from dist_loop.files import atomic_write_json
from dist_loop.memory import peak_memory_mb
from dist_loop.modes.base import Reporting, Trainer
from dist_loop.summaries import Summaries

PROBE_BATCH = 256


class Controller:
  """Runs a `Trainer` to `config.train_steps` with the run's side work."""

  def __init__(self, config: Config, trainer: Trainer, evaluator: Evaluator,
               summaries: Summaries, manager: tf.train.CheckpointManager,
               summary_path: Optional[str]):
    self.config = config
    self.trainer = trainer
    self.evaluator = evaluator
    self.summaries = summaries
    self.manager = manager
    self.summary_path = summary_path
    self._window = _Window()
    self._steady_examples = 0
    self._steady_seconds = 0.0
    self._last_train: Dict[str, float] = {}
    self._last_eval: Dict[str, float] = {}
    self._last_eval_step = -1
    self._skipped = 0
    self._rollbacks = 0
    self._preempted = False

  # -- the schedule --

  def _next_stop(self, step: int) -> int:
    """The next step at which the controller has something to do."""
    cfg = self.config
    stop = min(step + cfg.steps_per_loop, cfg.train_steps)
    for every in (cfg.log_every, cfg.eval_every, cfg.checkpoint_every,
                  cfg.histogram_every):
      if every:
        stop = min(stop, (step // every + 1) * every)
    if cfg.profile_range:  # Profile exactly steps FIRST..LAST.
      first, last = cfg.profile_range
      for edge in (first - 1, last):
        if edge > step:
          stop = min(stop, edge)
    return stop

  def run(self) -> Dict[str, object]:
    """Trains to the last step, then evaluates, checkpoints and summarises."""
    cfg = self.config
    start_time = time.time()
    step = self._step()
    if step >= cfg.train_steps:
      logging.info("Already trained to step %d of %d; nothing to train.",
                   step, cfg.train_steps)
    first_loop = True
    previous_handler = self._install_sigterm_handler()
    try:
      while step < cfg.train_steps:
        target = self._next_stop(step)
        if first_loop:
          self.summaries.trace_begin()
        profile = self.config.profile_range
        if profile and step == profile[0] - 1:
          self.summaries.profile_begin()
        t0 = time.time()
        try:
          metrics = self.trainer.train(target - step)
        except NonFiniteError as e:
          step = self._on_nonfinite(e)
          continue
        seconds = time.time() - t0
        self._skipped += int(metrics.pop("train/skipped_steps", 0))
        if first_loop:
          self.summaries.trace_end(target)
        new_step = self._step()
        if new_step != target:
          raise RuntimeError(f"the step counter is at {new_step} after "
                             f"training from {step} to {target}")
        examples = (target - step) * self.trainer.examples_per_step
        if not first_loop:  # The first loop includes tracing: not steady.
          self._steady_examples += examples
          self._steady_seconds += seconds
        first_loop = False
        self._window.add(metrics, target - step, examples, seconds)
        step = target
        if profile and step == profile[1]:
          self.summaries.profile_end()
        self._after_loop(step)
        if self._preempted:
          self._save(step)
          raise Interrupted(step, "SIGTERM")
    except KeyboardInterrupt:
      self._save(self._step())
      raise Interrupted(self._step(), "SIGINT") from None
    finally:
      if previous_handler is not None:
        signal.signal(signal.SIGTERM, previous_handler)
    if self._last_eval_step != step:
      self._evaluate(step)
    if self.manager.latest_checkpoint is None or self._saved_step() != step:
      self._save(step)
    return self._write_summary(step, time.time() - start_time)

  # -- faults --

  def _on_nonfinite(self, error: NonFiniteError) -> int:
    """`--nonfinite=rollback`: back to the last checkpoint; else re-raise."""
    cfg = self.config
    self.summaries.scalars(error.step, {"nonfinite/at_step": error.step})
    if cfg.nonfinite != "rollback":
      self.summaries.flush()
      raise error
    self._rollbacks += 1
    self.summaries.scalars(error.step, {"nonfinite/rollbacks": self._rollbacks})
    if self._rollbacks > cfg.max_rollbacks:
      self.summaries.flush()
      raise UserError(
          f"non-finite loss or gradients at step {error.step} after "
          f"{cfg.max_rollbacks} rollbacks (--max_rollbacks); lower "
          "--learning_rate, or check the input data") from None
    path = checkpoints.restore_latest(self.manager, self.trainer.scope())
    if path is None:
      raise UserError(f"non-finite values at step {error.step} and no "
                      "checkpoint to roll back to yet; lower "
                      "--checkpoint_every or --learning_rate") from None
    self.trainer.on_restore()
    logging.warning("Non-finite values at step %d: rolled back to %s "
                    "(rollback %d of at most %d).", error.step, path,
                    self._rollbacks, cfg.max_rollbacks)
    return self._step()

  def _install_sigterm_handler(self):
    """SIGTERM (preemption) asks for a checkpoint at the end of the current
    inner loop and an exit; a watchdog ends the process if that takes more
    than --grace_period_s. Returns the previous handler (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
      return None

    def on_sigterm(signum, frame):
      del signum, frame
      if self._preempted:
        return
      self._preempted = True
      logging.warning("SIGTERM: saving a checkpoint and exiting within %gs.",
                      self.config.grace_period_s)
      threading.Thread(target=self._grace_watchdog, daemon=True).start()

    return signal.signal(signal.SIGTERM, on_sigterm)

  def _grace_watchdog(self):
    time.sleep(self.config.grace_period_s)
    logging.error("No checkpoint within --grace_period_s=%g after SIGTERM; "
                  "exiting. The last saved checkpoint is intact.",
                  self.config.grace_period_s)
    os._exit(143)  # pylint: disable=protected-access

  def _after_loop(self, step: int) -> None:
    cfg = self.config
    last = step == cfg.train_steps
    if step % cfg.log_every == 0 or last:
      self._log(step)
    if cfg.histogram_every and step % cfg.histogram_every == 0:
      self._histograms(step)
    if step % cfg.eval_every == 0 or last:
      self._evaluate(step)
    if step % cfg.checkpoint_every == 0 or last:
      self._save(step)

  # -- the side work --

  def _log(self, step: int) -> None:
    metrics = self._window.flush()
    self._last_train = metrics
    rate = metrics.pop("examples_per_sec")
    steps_per_sec = metrics.pop("steps_per_sec")
    remaining = self.config.train_steps - step
    eta = datetime.timedelta(seconds=int(remaining / max(steps_per_sec, 1e-9)))
    self.summaries.scalars(step, {"nonfinite/skipped_steps": self._skipped})
    self.summaries.scalars(step, {**metrics, "train/examples_per_sec": rate,
                                  "train/steps_per_sec": steps_per_sec,
                                  **peak_memory_mb(self.trainer.devices)})
    if isinstance(self.trainer, Reporting):
      report = self.trainer.report()
      self.summaries.images(step, report.images)
      self.summaries.scalars(step, report.scalars)
      self.summaries.histograms(step, report.histograms)
    logging.info("step %d/%d  loss %.4f  acc %.3f  %.0f ex/s  eta %s", step,
                 self.config.train_steps, metrics.get("train/loss", np.nan),
                 metrics.get("train/accuracy", np.nan), rate, eta)

  def _evaluate(self, step: int) -> None:
    with self.trainer.scope():
      self._last_eval = self.evaluator.evaluate()
    self._last_eval_step = step
    self.summaries.scalars(step, self._last_eval)
    logging.info("step %d  eval loss %.4f  eval acc %.4f", step,
                 self._last_eval["eval/loss"],
                 self._last_eval["eval/accuracy"])

  def _histograms(self, step: int) -> None:
    model = self.trainer.model
    split = self.trainer.dataset
    x, y = split.train_x[:PROBE_BATCH], split.train_y[:PROBE_BATCH]
    grads = self.trainer.on_master(probe_gradients, model, x, y)
    values = {}
    for var, grad in zip(model.trainable_variables, grads):
      values[f"weights/{var.path}"] = np.asarray(var)
      values[f"gradients/{var.path}"] = np.asarray(grad)
    self.summaries.histograms(step, values)

  def _save(self, step: int) -> None:
    path = self.manager.save(checkpoint_number=step)
    logging.info("step %d  saved checkpoint %s", step, path)

  def _saved_step(self) -> int:
    return int(self.manager.latest_checkpoint.rsplit("-", 1)[-1])

  def _step(self) -> int:
    return int(self.trainer.step.numpy())

  def _write_summary(self, step: int, wall_time: float) -> Dict[str, object]:
    steady = (self._steady_examples / self._steady_seconds
              if self._steady_seconds else self._window.total_rate())
    summary = {
        "final_step": step,
        "train_loss": self._last_train.get("train/loss"),
        "train_accuracy": self._last_train.get("train/accuracy"),
        "eval_loss": self._last_eval.get("eval/loss"),
        "eval_accuracy": self._last_eval.get("eval/accuracy"),
        "examples_per_sec": steady,
        "wall_time_s": wall_time,
        "mode": self.config.mode,
        "num_devices": self.config.num_devices,
    }
    summary["skipped_steps"] = self._skipped
    summary["rollbacks"] = self._rollbacks
    if isinstance(self.trainer, Reporting):
      summary.update(self.trainer.summary())
    summary.update({k.replace("memory/", "memory_"): v
                    for k, v in peak_memory_mb(self.trainer.devices).items()})
    if self.summary_path:
      atomic_write_json(self.summary_path, summary)
    self.summaries.flush()
    return summary


class _Window:
  """Step-weighted means of the train metrics since the last log line."""

  def __init__(self):
    self._sums: Dict[str, float] = {}
    self._steps = 0
    self._examples = 0
    self._seconds = 0.0
    self._all_examples = 0
    self._all_seconds = 0.0

  def add(self, metrics, steps, examples, seconds):
    for k, v in metrics.items():
      self._sums[k] = self._sums.get(k, 0.0) + v * steps
    self._steps += steps
    self._examples += examples
    self._seconds += seconds
    self._all_examples += examples
    self._all_seconds += seconds

  def flush(self) -> Dict[str, float]:
    out = {k: v / max(self._steps, 1) for k, v in self._sums.items()}
    out["examples_per_sec"] = self._examples / max(self._seconds, 1e-9)
    out["steps_per_sec"] = self._steps / max(self._seconds, 1e-9)
    self._sums, self._steps, self._examples, self._seconds = {}, 0, 0, 0.0
    return out

  def total_rate(self) -> float:
    return self._all_examples / max(self._all_seconds, 1e-9)
