"""Actions: the host work the controller schedules between inner loops.

`base.py` says what an action is. A run's list, from `standard(config,
inputs)`, in the order they run after a loop: the graph trace, the profile,
the log line, histograms, evaluation, the checkpoint, goodput and, at the
end, summary.json. What the actions need from the run reaches them through
`Inputs`, built by `dist_loop/train.py`: callables and values, never the
trainer, so each action can be tested alone with fakes.
"""

import dataclasses
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from dist_loop.control import divergence
from dist_loop.control.actions.base import Action, Loop
from dist_loop.control.actions.checkpoint import Checkpoint
from dist_loop.control.actions.diagnostics import Histograms, Profile
from dist_loop.control.actions.diagnostics import TraceGraph
from dist_loop.control.actions.evaluate import Evaluate
from dist_loop.control.actions.goodput import Goodput
from dist_loop.control.actions.log import Log
from dist_loop.control.actions.summary import Part, Summary
from dist_loop.runtime.memory import peak_memory_mb

__all__ = ["Action", "Checkpoint", "Evaluate", "Goodput", "Histograms",
           "Inputs", "Log", "Loop", "Profile", "Summary", "TraceGraph",
           "standard"]


@dataclasses.dataclass(frozen=True)
class Inputs:
  """What the standard actions need from a run.

  Attributes:
    summaries: the run's `Summaries`.
    evaluator: has `evaluate() -> {"eval/<name>": value}`.
    scope: returns the context the master variables are read under.
    checkpointer: has `save(step)`, `wait()` and `saved_step`.
    metric_names: the task's metrics (the progress line).
    reported_names: what the task reports, derived metrics included
      (summary.json's `train_<name>`).
    learning_rate: `fn(step)`: the learning rate of the update that reached
      `step`.
    devices: the run's devices (peak memory).
    model: the model holding the master variables (histograms).
    probe_batch: a fixed batch (x, y) of training examples (histograms).
    probe_gradients: `(model, x, y) -> gradients` on the master variables.
    report: the mode's `Reporting.report`, asked at each log line, or None.
    tokens_per_example: predictions per example (tokens per second).
    summary_path: where summary.json goes, or None (not the chief).
    summary_parts: more summary.json entries (the mode's, the rollbacks).
    previous: the summary.json the workdir holds from an earlier run, or {}.
    goodput: the attempt's `goodput.Recorder`, or None (no goodput).
  """

  summaries: Any
  evaluator: Any
  scope: Callable[[], Any]
  checkpointer: Any
  metric_names: Sequence[str]
  reported_names: Sequence[str]
  learning_rate: Callable[[int], float]
  devices: Sequence[str]
  model: Any = None
  probe_batch: Optional[Tuple[Any, Any]] = None
  probe_gradients: Optional[Callable] = None
  report: Optional[Callable[[], Any]] = None
  tokens_per_example: int = 1
  summary_path: Optional[str] = None
  summary_parts: Sequence[Part] = ()
  previous: Mapping[str, object] = dataclasses.field(default_factory=dict)
  goodput: Any = None


def standard(config, inputs: Inputs) -> List[Action]:
  """The actions of a run, from its config, in the order they run."""
  summaries = inputs.summaries
  out: List[Action] = [TraceGraph(summaries)]
  if config.profile_range:
    out.append(Profile(*config.profile_range, summaries))
  log = Log(config.log_every, config.train_steps, summaries,
            metric_names=inputs.metric_names,
            reported_names=inputs.reported_names,
            learning_rate=inputs.learning_rate, devices=inputs.devices,
            report=inputs.report,
            tokens_per_example=inputs.tokens_per_example,
            previous=inputs.previous)
  out.append(log)
  if config.histogram_every:
    out.append(Histograms(config.histogram_every, inputs.model,
                          inputs.probe_batch, inputs.probe_gradients,
                          summaries))
  evaluate = Evaluate(config.eval_every, inputs.evaluator, inputs.scope,
                      summaries)
  out.append(evaluate)
  out.append(Checkpoint(config.checkpoint_every, inputs.checkpointer,
                        config.train_steps))
  goodput = []
  if inputs.goodput is not None:
    goodput = [Goodput(config.log_every, inputs.goodput, summaries,
                       compiles=config.jit_compile)]
    out += goodput
  parts = [lambda: {"mode": config.mode, "num_devices": config.num_devices,
                    "jit_compile": config.jit_compile},
           log.summary, evaluate.summary, *inputs.summary_parts,
           lambda: {k.replace("memory/", "memory_"): v
                    for k, v in peak_memory_mb(inputs.devices).items()},
           divergence.Verdict(log, evaluate,
                              config.diverged_loss_ratio).summary,
           *(action.summary for action in goodput)]
  out.append(Summary(inputs.summary_path, summaries, parts,
                     lambda: inputs.checkpointer.saved_step))
  return out
