"""Stand-ins for what the controller drives, for tests/test_controller.py.

Nothing here trains: the fake trainer moves a step counter and returns
metrics that are a function of the steps, so every event's step and every
logged mean can be checked exactly.
"""

import contextlib
import types

import numpy as np

from dist_loop import actions
from dist_loop.config import Config
from dist_loop.controller import Controller
from dist_loop.errors import NonFiniteError
from dist_loop.modes.base import Report, Reporting

EXAMPLES_PER_STEP = 8


class FakeTrainer:
  """The Trainer contract, and nothing else.

  Step s has loss 1/s. Steps in `skip` advance the counter without applying
  their update (--nonfinite=skip); a step in `nan` raises NonFiniteError
  (`nan_times` times, then it is fine). `on_train(start, n)` runs first.
  """

  examples_per_step = EXAMPLES_PER_STEP
  devices = ["/device:CPU:0"]
  is_chief = True

  def __init__(self, log, nan=(), nan_times=1, skip=(), lag=0, on_train=None):
    self.value = 0
    self.step = self  # What the controller reads: step.numpy().
    self.optimizer = types.SimpleNamespace(learning_rate=0.25)
    self.log, self.skip, self.lag = log, set(skip), lag
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
    applied = [s for s in range(start + 1, start + n + 1)
               if s not in self.skip]
    return {"train/loss": float(np.mean([1 / s for s in applied])),
            "train/accuracy": 0.5,
            "train/skipped_steps": float(n - len(applied))}

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

  def __init__(self, trainer, log):
    self.trainer, self.log = trainer, log

  def evaluate(self):
    self.log.append(("eval", self.trainer.value))
    return {"eval/loss": 2.0 / self.trainer.value, "eval/accuracy": 0.75,
            "eval/perplexity": 3.0}


class FakeCheckpointer:
  """Keeps the step of each save; restore moves the counter back."""

  def __init__(self, trainer, log):
    self.trainer, self.log = trainer, log
    self.saved = []

  def save(self, step):
    if self.saved and self.saved[-1] == step:
      return None
    assert self.trainer.value == step
    self.saved.append(step)
    self.log.append(("save", step))
    return f"ckpt-{step}"

  def restore(self, scope):
    del scope
    if not self.saved:
      return None
    self.trainer.value = self.saved[-1]
    self.log.append(("restore", self.saved[-1]))
    return f"ckpt-{self.saved[-1]}"


class FakeSummaries:
  """Keeps the scalars; logs the graph trace and the profile."""

  def __init__(self, log):
    self.log = log
    self.scalar = {}  # name -> {step: value}

  def scalars(self, step, values):
    for name, value in values.items():
      self.scalar.setdefault(name, {})[step] = value

  def __getattr__(self, name):  # trace_begin(), trace_end(step), ...
    if name.startswith(("trace_", "profile_")):
      return lambda *args: self.log.append((name, *args))
    return lambda *args: None  # histograms, images, flush


def run(tmp_path, trainer_class=FakeTrainer, summary=True, start=0,
         on_exit=None, **overrides):
  """Runs a controller with the standard actions over fakes.

  Returns: `result` (the summary or the exception), `log` (what happened,
  in order), `scalar` ({name: {step: value}}), `trainer`, `saved` (steps).
  """
  trainer_kwargs = {k: overrides.pop(k) for k in
                    ("nan", "nan_times", "skip", "lag", "on_train")
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
  controller = Controller(
      config, trainer, checkpointer, summaries,
      actions.standard(config, trainer, FakeEvaluator(trainer, log),
                       checkpointer, summaries, task=None),
      str(tmp_path / "summary.json") if summary else None,
      metric_names=("loss", "accuracy", "perplexity"))

  def fake_exit(code):  # The watchdog's os._exit.
    log.append(("exit", code))
    if on_exit:
      on_exit()

  controller._exit = fake_exit  # pylint: disable=protected-access
  try:
    result = controller.run()
  except Exception as e:  # pylint: disable=broad-except
    result = e
  return types.SimpleNamespace(result=result, log=log, trainer=trainer,
                               scalar=summaries.scalar,
                               saved=checkpointer.saved)


