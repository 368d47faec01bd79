"""The async mode's threads, from one start to their stop.

    worker w (one thread each, own device, own model copy, own input shard)
      loop: (v, weights, s) = applier.read(); g = grad(batch, weights, s)
            [straggler sleep]; put Push(g, v, weights, w, s);
            wait until the applier has applied, dropped or skipped it
    applier (one thread, owns master variables + optimizer + step)
      loop: wait for a budget of n updates from `run(n)`, then
            pop pushes: tau = version - v; drop if tau > --max_staleness,
            skip a float16 overflow, else apply with the staleness
            policies; version += 1
    main thread (`run(n)`, from the trainer's `train(n)`)
      hands the applier n, waits for its `Tally`, raises any thread's error.

A worker has one push in flight at most, so the queue (W slots) never
blocks for long and memory stays flat. Between `run` calls the applier
idles, so evaluation and checkpoints see still master variables; the
workers wait on their last push meanwhile. Every wait is bounded and
stop-aware (`threads.Crew`). A session ends at `close`; after a rollback the
trainer starts a new one, so pushes computed on abandoned weights are
dropped with the old queue.
"""

import dataclasses
import queue
import threading
import time
from typing import Dict, List, Optional

from dist_loop.parallel import staleness
from dist_loop.parallel import straggler as straggler_lib
from dist_loop.parallel.modes.asynchronous.applier import Applier, Outcome
from dist_loop.parallel.modes.asynchronous.threads import Crew, Stopped
from dist_loop.parallel.modes.asynchronous.worker import Push, Worker
from dist_loop.training import optim


@dataclasses.dataclass
class Tally:
  """What the applier did for one `run(n)` call."""

  applied: int = 0
  dropped: int = 0
  skipped: int = 0  # Loss-scale overflows: pushes neither applied nor errors.
  sums: Dict[str, float] = dataclasses.field(default_factory=dict)
  grad_norm: float = 0.0
  clipped: Optional[int] = None  # Applied pushes clipped; None: no clipping.
  taus: staleness.Histogram = dataclasses.field(
      default_factory=staleness.Histogram)
  bad_step: int = -1  # The step a non-finite push would have been, or -1.

  def add(self, push: Push, outcome: Outcome) -> None:
    """Counts an applied push: its batch's metrics, norm and staleness."""
    self.applied += 1
    for name, value in push.metrics.items():
      self.sums[name] = self.sums.get(name, 0.0) + float(value)
    self.grad_norm += outcome.grad_norm
    if outcome.clipped is not None:
      self.clipped = (self.clipped or 0) + int(outcome.clipped)
    self.taus.add([outcome.tau])

  def means(self) -> Dict[str, float]:
    """The task's metrics and the norm of each applied update's gradient,
    averaged over the applied updates; empty if none was applied."""
    if not self.applied:
      return {}
    n = self.applied
    clipped = ({} if self.clipped is None else
               {optim.Recipe.CLIPPED: self.clipped / n})
    return {**{k: v / n for k, v in self.sums.items()},
            "grad_norm": self.grad_norm / n, **clipped}


class Session:
  """W worker threads and one applier thread around a bounded queue."""

  def __init__(self, applier: Applier, workers: List[Worker],
               straggler: Optional[straggler_lib.Straggler] = None):
    self.applier = applier
    self.workers = workers
    self.straggler = straggler
    self.crew = Crew()
    self._pushes: "queue.Queue[Push]" = queue.Queue(maxsize=len(workers))
    self._processed = [threading.Event() for _ in workers]
    self._budgets: "queue.Queue[int]" = queue.Queue()
    self._tallies: "queue.Queue[Tally]" = queue.Queue()

  def start(self) -> None:
    """Starts the threads at the applier's version (the restored step):
    each worker's input resumes at its share of the steps so far."""
    self.applier.sync_version()
    start = self.applier.version // len(self.workers)
    self.applier.trace()
    for w in self.workers:
      w.start_input(start)
      w.trace()
    for w in self.workers:
      self.crew.start(f"async-worker-{w.index}", w.name, self._worker_loop, w)
    self.crew.start("async-applier", "async applier", self._applier_loop)

  def run(self, budget: int) -> Tally:
    """Has the applier apply `budget` updates; returns what it did.

    Raises:
      WorkerFailed: a thread failed (every thread was stopped).
      RuntimeError: the session was closed.
    """
    self._budgets.put(budget)
    try:
      return self.crew.get(self._tallies)
    except Stopped:
      self.crew.check()
      raise RuntimeError("the async threads were stopped") from None

  def close(self) -> List[str]:
    """Stops the threads; returns the names of any still running."""
    return self.crew.close()

  # -- the threads --

  def _worker_loop(self, worker: Worker) -> None:
    processed = self._processed[worker.index]
    while not self.crew.stop.is_set():
      x, y = worker.next_batch()
      version, read, loss_scale = self.applier.read()
      t0 = time.perf_counter()
      push = worker.compute(version, read, x, y, loss_scale)
      if self.straggler is not None:
        straggler_lib.sleep(
            self.straggler.delay(worker.index, time.perf_counter() - t0),
            self.crew.stop)
      # Like a push to a parameter server, the push returns once the applier
      # has dealt with it: only the other workers' updates make a gradient
      # stale, and with one worker async is exactly sequential SGD.
      processed.clear()
      self.crew.put(self._pushes, push)
      self.crew.wait(processed)

  def _applier_loop(self) -> None:
    while True:
      budget = self.crew.get(self._budgets)
      tally = Tally()
      while tally.applied < budget:
        push = self.crew.get(self._pushes)
        outcome = self.applier.offer(push)
        self._processed[push.worker].set()
        if not outcome.finite:
          tally.bad_step = self.applier.version + 1
          break
        if outcome.applied:
          tally.add(push, outcome)
        elif outcome.skipped:
          tally.skipped += 1
        else:
          tally.dropped += 1
      self._tallies.put(tally)
