"""The outer loop: when to train, log, evaluate, checkpoint and stop.

The controller never computes a step; it asks the mode's `Trainer` for
`train(n)` and schedules everything else around it. Each inner loop runs up to
the next event (a log, eval, checkpoint or histogram boundary, at most
`steps_per_loop` steps), so events land on exact steps without retracing: the
step count reaches the traced loop as a tensor.
"""

import datetime
import time
from typing import Dict, Optional

import numpy as np
import tensorflow as tf
from absl import logging

from dist_loop.config import Config
from dist_loop.errors import UserError
from dist_loop.evaluation import Evaluator, probe_gradients
from dist_loop.files import atomic_write_json
from dist_loop.modes.base import Trainer
from dist_loop.summaries import Summaries

PROBE_BATCH = 256


class Interrupted(UserError):
  """Ctrl-C: the checkpoint at `step` was saved; rerunning resumes."""

  def __init__(self, step: int):
    self.step = step
    super().__init__(f"interrupted at step {step}; a checkpoint was saved. "
                     "Rerun the same command to resume.")


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

  # -- the schedule --

  def _next_stop(self, step: int) -> int:
    """The next step at which the controller has something to do."""
    cfg = self.config
    stop = min(step + cfg.steps_per_loop, cfg.train_steps)
    for every in (cfg.log_every, cfg.eval_every, cfg.checkpoint_every,
                  cfg.histogram_every):
      if every:
        stop = min(stop, (step // every + 1) * every)
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
    try:
      while step < cfg.train_steps:
        target = self._next_stop(step)
        if first_loop:
          self.summaries.trace_begin()
        t0 = time.time()
        metrics = self.trainer.train(target - step)
        seconds = time.time() - t0
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
        self._after_loop(step)
    except KeyboardInterrupt:
      self._save(self._step())
      raise Interrupted(self._step()) from None
    if self._last_eval_step != step:
      self._evaluate(step)
    if self.manager.latest_checkpoint is None or self._saved_step() != step:
      self._save(step)
    return self._write_summary(step, time.time() - start_time)

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
    self.summaries.scalars(step, {**metrics, "train/examples_per_sec": rate,
                                  "train/steps_per_sec": steps_per_sec})
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
    split = self.trainer.split
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
