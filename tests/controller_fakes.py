"""Stand-ins for what the controller and the actions drive, for
tests/test_controller.py, tests/test_actions.py and tests/test_preemption.py.

Nothing here trains: the fake trainer moves a step counter and returns
metrics that are a function of the steps, so every event's step and every
logged mean can be checked exactly.
"""

import contextlib
import types

import numpy as np

from dist_loop.control import actions
from dist_loop.control.controller import Controller
from dist_loop.control.recovery import NonFinitePolicy
from dist_loop.core.config import Config
from dist_loop.core.errors import NonFiniteError
from dist_loop.parallel.modes.base import Report, Reporting

EXAMPLES_PER_STEP = 8
METRICS = ("loss", "accuracy")
REPORTED = ("loss", "accuracy", "perplexity")


class FakeTrainer:
  """The Trainer contract, and nothing else.

  Step s has loss `loss(s)` (default 1/s). Steps in `skip` advance the
  counter without applying their update (--nonfinite=skip), and like the
  loop base a call that applies none returns no task metric; a step in `nan`
  raises NonFiniteError (`nan_times` times, then it is fine). `on_train(start,
  n)` runs first.
  """

  examples_per_step = EXAMPLES_PER_STEP
  devices = ["/device:CPU:0"]
  is_chief = True

  def __init__(self, log, nan=(), nan_times=1, skip=(), lag=0, on_train=None,
               loss=lambda s: 1 / s):
    self.value = 0
    self.step = self  # What the controller reads: step.numpy().
    self.learning_rate = 0.25
    self.log, self.skip, self.lag, self.loss = log, set(skip), lag, loss
    self.nan = {s: nan_times for s in nan}
    self.on_train = on_train or (lambda start, n: None)
    self.restores = 0

  def numpy(self):
    return np.int64(self.value)

  def train(self, n):
    start = self.value
    self.log.append(("train", start, n))
    self.on_train(start, n)
    for s in range(start + 1, start + n + 1):
      if self.nan.get(s):
        self.nan[s] -= 1
        self.value = s
        raise NonFiniteError(s)
    self.value = start + n - self.lag  # A broken mode falls short.
    steps = range(start + 1, start + n + 1)
    applied = [s for s in steps if s not in self.skip]
    at_end = next((i for i, s in enumerate(reversed(steps))
                   if s not in self.skip), n)
    out = {"train/skipped_steps": float(n - len(applied)),
           "train/skipped_steps_at_end": float(at_end)}
    if applied:
      out["train/loss"] = float(np.mean([self.loss(s) for s in applied]))
      out["train/accuracy"] = 0.5
    return out

  def scope(self):
    return contextlib.nullcontext()

  def on_restore(self):
    self.restores += 1


class ReportingTrainer(FakeTrainer, Reporting):

  def report(self):
    return Report(scalars={"fake/running": float(self.value)})

  def summary(self):
    return {"fake_total": 7}


class FakeEvaluator:
  """`eval/loss` is 2/step, or `value` if given."""

  def __init__(self, trainer, log, value=None):
    self.trainer, self.log, self.value = trainer, log, value

  def evaluate(self):
    self.log.append(("eval", self.trainer.value))
    loss = 2.0 / self.trainer.value if self.value is None else self.value
    return {"eval/loss": loss, "eval/accuracy": 0.75,
            "eval/perplexity": 3.0}


class FakeCheckpointer:
  """Keeps the step of each save; restore moves the counter back."""

  def __init__(self, trainer, log):
    self.trainer, self.log = trainer, log
    self.saved = []
    self.waited = []  # saved_step at each wait for a background save.

  @property
  def saved_step(self):
    return self.saved[-1] if self.saved else None

  def save(self, step):
    if self.saved and self.saved[-1] == step:
      return None
    assert self.trainer.value == step
    self.saved.append(step)
    self.log.append(("save", step))
    return f"ckpt-{step}"

  def wait(self):
    self.waited.append(self.saved_step)

  def restore(self, scope):
    del scope
    if not self.saved:
      return None
    self.trainer.value = self.saved[-1]
    self.log.append(("restore", self.saved[-1]))
    return f"ckpt-{self.saved[-1]}"


class FakeSummaries:
  """Keeps the scalars and the final summary; logs the graph trace, the
  profile and flushes."""

  def __init__(self, log):
    self.log = log
    self.scalar = {}  # name -> {step: value}
    self.final_summary = None

  def scalars(self, step, values):
    for name, value in values.items():
      self.scalar.setdefault(name, {})[step] = value

  def final(self, summary):
    self.final_summary = dict(summary)

  def __getattr__(self, name):  # trace_begin(), trace_end(step), ...
    if name.startswith(("trace_", "profile_")):
      return lambda *args: self.log.append((name, *args))
    return lambda *args: None  # histograms, images, flush


def inputs(trainer, log, summaries, checkpointer, evaluator=None,
           summary_path=None, **overrides):
  """`actions.Inputs` over the fakes."""
  fields = dict(
      summaries=summaries,
      evaluator=evaluator or FakeEvaluator(trainer, log),
      scope=trainer.scope, checkpointer=checkpointer,
      metric_names=METRICS, reported_names=REPORTED,
      learning_rate=lambda step: trainer.learning_rate, devices=trainer.devices,
      report=trainer.report if isinstance(trainer, Reporting) else None,
      summary_path=summary_path)
  fields.update(overrides)
  return actions.Inputs(**fields)


def run(tmp_path, trainer_class=FakeTrainer, summary=True, start=0,
        stop=None, eval_value=None, previous=None, **overrides):
  """Runs a controller with the standard actions over fakes.

  `stop` is the controller's stop request, or a function of the trainer
  that returns one.

  Returns: `result` (the summary or the exception), `log` (what happened,
  in order), `scalar` ({name: {step: value}}), `trainer`, `saved` (steps),
  `actions`, `controller`.
  """
  trainer_kwargs = {k: overrides.pop(k) for k in
                    ("nan", "nan_times", "skip", "lag", "on_train", "loss")
                    if k in overrides}
  fields = dict(workdir=str(tmp_path), train_steps=20, steps_per_loop=10,
                log_every=5, eval_every=10, checkpoint_every=10)
  fields.update(overrides)
  config = Config(**fields)
  log = []
  trainer = trainer_class(log, **trainer_kwargs)
  trainer.value = start
  checkpointer = FakeCheckpointer(trainer, log)
  if start:
    checkpointer.saved.append(start)
  summaries = FakeSummaries(log)
  recovery = NonFinitePolicy(config, checkpointer, trainer, summaries)
  parts = [recovery.summary]
  if isinstance(trainer, Reporting):
    parts.append(trainer.summary)
  run_actions = actions.standard(config, inputs(
      trainer, log, summaries, checkpointer,
      evaluator=FakeEvaluator(trainer, log, eval_value),
      summary_path=str(tmp_path / "summary.json") if summary else None,
      summary_parts=parts, previous=previous or {}))
  if callable(stop) and not hasattr(stop, "requested"):
    stop = stop(trainer)
  controller = Controller(trainer, run_actions,
                          train_steps=config.train_steps,
                          steps_per_loop=config.steps_per_loop,
                          recovery=recovery, stop=stop)
  summary_action = next(a for a in run_actions
                        if isinstance(a, actions.Summary))
  try:
    controller.run()
    result = summary_action.written
  except Exception as e:  # pylint: disable=broad-except
    result = e
  return types.SimpleNamespace(result=result, log=log, trainer=trainer,
                               scalar=summaries.scalar,
                               saved=checkpointer.saved, actions=run_actions,
                               controller=controller, summaries=summaries)
