"""The progress line and the train scalars.

At each log line: the means of the train metrics since the last line, each
averaged over the updates that produced it (a skipped step has no loss, so a
line whose steps were all skipped prints `loss -`, never a 0); the rates;
the learning rate of the step logged; memory; and the mode's
`Reporting.report()`.

`Log` also keeps the train values of summary.json (the last logged value of
each metric the task reports, and `train_learning_rate`) and the two losses
a divergence is judged by (`dist_loop/control/divergence.py`): the last logged
loss and the loss of the run's first step. For that first loss it ends the run's
first inner loop after one step: a mean over a longer first window already
holds the blow-up of a run that is unstable from its first steps (SGD at
--learning_rate=1e6 on the digits reaches a loss of 1e25 within 10 steps).
"""

import datetime
from typing import Callable, Dict, Mapping, Optional, Sequence

from absl import logging

from dist_loop.control.actions.base import Action, Loop
from dist_loop.runtime.memory import peak_memory_mb

# Short names on the progress line.
_LABELS = {"accuracy": "acc"}


class Log(Action):
  """The progress line every `every` steps and at the end.

  Args:
    every: steps between lines.
    train_steps: the run's last step (for the ETA).
    summaries: `Summaries`.
    metric_names: the task's metrics, shown on the line in this order.
    reported_names: what the task reports (its metrics and derived ones,
      such as `bits_per_byte`): summary.json's `train_<name>` entries.
    learning_rate: `fn(step)`: the learning rate of the update that
      reached `step` (the schedule's, a function of the step).
    devices: the run's devices (peak memory).
    report: the mode's `Reporting.report` (returns a `Report`), or None.
    tokens_per_example: predictions per example; above 1 the line shows
      tokens per second.
    previous: the summary.json an earlier run left in the workdir, or {}:
      its train values and first loss stand until this run logs its own.
  """

  at_end = True

  def __init__(self, every: int, train_steps: int, summaries, *,
               metric_names: Sequence[str], reported_names: Sequence[str],
               learning_rate: Callable[[int], float], devices: Sequence[str],
               report: Optional[Callable[[], object]] = None,
               tokens_per_example: int = 1,
               previous: Optional[Mapping[str, object]] = None):
    self.every = every
    self._train_steps = train_steps
    self._summaries = summaries
    self._metric_names = tuple(metric_names)
    self._reported_names = tuple(reported_names)
    self._learning_rate = learning_rate
    self._devices = devices
    self._report = report
    self._tokens_per_example = tokens_per_example
    previous = {k: float(v) for k, v in (previous or {}).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
    self.first_loss: Optional[float] = previous.get("first_train_loss")
    self._last: Dict[str, float] = {
        f"train/{name}": previous[f"train_{name}"]
        for name in self._reported_names + ("learning_rate",)
        if f"train_{name}" in previous}
    self._first_stop: Optional[int] = None
    self._skipped_total = 0
    self._reset()

  @property
  def last_loss(self) -> Optional[float]:
    """The train loss of the last line that had one."""
    return self._last.get("train/loss")

  def _reset(self):
    self._sums: Dict[str, float] = {}
    self._weights: Dict[str, int] = {}
    self._state: Dict[str, float] = {}  # Reported by loops with no update.
    self._steps = self._updates = self._examples = 0
    self._seconds = 0.0

  def start(self, step: int) -> None:
    if self.first_loss is None:
      self._first_stop = step + 1

  def stops(self, step: int) -> Optional[int]:
    regular = super().stops(step)
    if self._first_stop is not None and step < self._first_stop:
      return self._first_stop
    return regular

  def observe(self, loop: Loop) -> None:
    for k, v in loop.metrics.items():
      if loop.updates:
        self._sums[k] = self._sums.get(k, 0.0) + v * loop.updates
        self._weights[k] = self._weights.get(k, 0) + loop.updates
      else:  # A value as it is now (the loss scale), not a mean of updates.
        self._state[k] = v
    if self.first_loss is None and "train/loss" in loop.metrics:
      self.first_loss = loop.metrics["train/loss"]
    self._steps += loop.steps
    self._updates += loop.updates
    self._examples += loop.examples
    self._seconds += loop.seconds
    self._skipped_total += loop.skipped

  def __call__(self, step: int) -> None:
    if not self._steps:
      return  # Nothing trained since the last line.
    means = dict(self._state)
    means.update((k, s / self._weights[k]) for k, s in self._sums.items())
    seconds = max(self._seconds, 1e-9)
    rates = {"train/examples_per_sec": self._examples / seconds,
             "train/steps_per_sec": self._steps / seconds,
             "train/updates_per_sec": self._updates / seconds}
    if self._tokens_per_example > 1:
      rates["train/tokens_per_sec"] = (rates["train/examples_per_sec"]
                                       * self._tokens_per_example)
    self._last["train/learning_rate"] = self._learning_rate(step)
    self._summaries.scalars(step, {
        **means, **rates,
        "train/learning_rate": self._last["train/learning_rate"],
        "nonfinite/skipped_steps": self._skipped_total,
        **peak_memory_mb(self._devices)})
    if self._report is not None:
      report = self._report()
      self._summaries.scalars(step, report.scalars)
      self._summaries.histograms(step, report.histograms)
      self._summaries.images(step, report.images)
    self._last.update((f"train/{name}", means[f"train/{name}"])
                      for name in self._reported_names
                      if f"train/{name}" in means)
    logging.info("%s", self._line(step, means, rates))
    self._reset()

  def summary(self) -> Dict[str, object]:
    """summary.json's train entries: the last logged value of each metric
    the task reports (None if no update was ever applied), the last logged
    learning rate, and `first_train_loss`, the loss divergence is measured
    against."""
    out = {f"train_{name}": self._last.get(f"train/{name}")
           for name in self._reported_names + ("learning_rate",)}
    out["first_train_loss"] = self.first_loss
    return out

  def _line(self, step: int, means: Mapping[str, float],
            rates: Mapping[str, float]) -> str:
    metrics = "  ".join(
        f"{_LABELS.get(name, name)} "
        f"{_number(means.get(f'train/{name}'), 4 if name == 'loss' else 3)}"
        for name in self._metric_names)
    throughput = (f"{rates['train/tokens_per_sec']:.0f} tok/s"
                  if "train/tokens_per_sec" in rates
                  else f"{rates['train/examples_per_sec']:.0f} ex/s")
    remaining = self._train_steps - step
    eta = datetime.timedelta(seconds=int(
        remaining / max(rates["train/steps_per_sec"], 1e-9)))
    return (f"step {step}/{self._train_steps}  {metrics}  {throughput}  "
            f"eta {eta}")


def _number(value: Optional[float], decimals: int) -> str:
  """A metric on the line: `-` if there is none (no update applied), and
  in exponent notation once fixed decimals would be a wall of digits."""
  if value is None:
    return "-"
  if abs(value) >= 1e5:
    return f"{value:.4g}"
  return f"{value:.{decimals}f}"
