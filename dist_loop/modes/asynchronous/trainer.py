"""Asynchronous data parallelism: worker threads, one applier, stale gradients.

TensorFlow has no in-process asynchronous strategy, so this mode is threads:

    worker w (one thread each, own device, own model copy, own input shard)
      loop: (v, weights, s) = applier.read(); g = grad(batch, weights, s)
            [straggler sleep]; queue.put(Push(g, v, weights, w, s));
            wait until the applier has applied, dropped or skipped it
    applier (one thread, owns master variables + optimizer + step)
      loop: wait for a budget of n updates from train(n), then
            pop pushes: tau = version - v; drop if tau > --max_staleness,
            skip a float16 overflow, else apply with the staleness
            policies; version += 1
    main thread (the controller's `train(n)`)
      hands the applier n, waits for its tally, raises any thread's error.

A worker has one push in flight at most, so the queue (W slots) never
blocks and memory stays flat. Between `train` calls the applier idles, so
evaluation and checkpoints see still master variables; the workers wait on
their last push meanwhile. Every get,
put and join has a timeout, and a failure in any thread stops all of them
and is raised in the main thread, naming the thread. The step logic itself
(`Worker.compute`, `Applier.offer`) lives in `worker.py` and `applier.py` and has no
threads, so tests can force any interleaving.

Each push is the gradient of one worker's batch of `--global_batch_size`
examples, so an applied update sees as many examples as a sync step does.

`--precision=mixed_float16` scales the loss dynamically, as sync mode does,
but the scale travels with each push instead of being in an all-reduce: the
applier owns the scale (checkpointed as "loss_scale", as in sync mode), a
worker computes at the scale it read and unscales its gradient, and the
applier skips an overflowing push and halves the scale only if the push used
the scale in force (applier.py). A skipped push, like a dropped one, is not
an update: `train(n)` still applies n, and reports the skips as
`train/skipped_steps`.
"""

import dataclasses
import queue
import threading
import time
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf
from absl import logging

from dist_loop import models, optim
from dist_loop import precision as precision_lib
from dist_loop import straggler as straggler_lib
from dist_loop.modes.asynchronous import policies
from dist_loop.modes.asynchronous.applier import Applier
from dist_loop.modes.asynchronous.worker import Push, Worker
from dist_loop.config import Config
from dist_loop.errors import NonFiniteError, UserError
from dist_loop.modes.base import MODES, Trainer

POLL_SECONDS = 0.05  # How often a blocked thread looks at the stop flag.
JOIN_SECONDS = 10.0


class WorkerFailed(RuntimeError):
  """A worker or the applier raised; the run was stopped."""

  def __init__(self, thread: str, error: BaseException):
    self.thread = thread
    super().__init__(f"{thread} failed: {type(error).__name__}: {error}")


class _Stopped(Exception):
  """Raised inside a thread's blocking call once the stop flag is set."""


@dataclasses.dataclass
class _Tally:
  """What the applier did for one `train(n)` call."""

  applied: int = 0
  dropped: int = 0
  skipped: int = 0
  loss: float = 0.0
  accuracy: float = 0.0
  grad_norm: float = 0.0
  taus: List[int] = dataclasses.field(default_factory=list)
  bad_step: int = -1

  def add(self, push: Push, grad_norm: float, tau: int) -> None:
    self.applied += 1
    self.loss += float(push.loss)
    self.accuracy += float(push.accuracy)
    self.grad_norm += grad_norm
    self.taus.append(tau)


@MODES.register("async")
class AsyncTrainer(Trainer):
  """W worker threads and one applier thread around a bounded queue."""

  precisions = precision_lib.PRECISIONS

  @classmethod
  def num_replicas(cls, config: Config) -> int:
    return 1  # Every worker computes on the whole --global_batch_size.

  @classmethod
  def num_workers(cls, config: Config) -> int:
    """--async_workers, or one worker per device when it is 0."""
    return config.async_workers or config.num_devices

  @classmethod
  def validate_config(cls, config: Config) -> None:
    super().validate_config(config)
    if config.async_workers < 0:
      raise UserError(f"--async_workers must be >= 0 (0: one per device), "
                      f"got {config.async_workers}")
    if config.max_staleness < policies.NO_BOUND:
      raise UserError(f"--max_staleness must be >= 0, or -1 for no bound; "
                      f"got {config.max_staleness}")
    if not config.dc_lambda >= 0:
      raise UserError(f"--dc_lambda must be >= 0, got {config.dc_lambda}")
    policies.STALENESS_LR.get(config.staleness_lr)
    policies.COMPENSATIONS.get(config.async_compensation)
    straggler_lib.check(config.straggler, cls.num_workers(config),
                        "async workers")

  def __init__(self, config, devices, split):
    super().__init__(config, devices, split)
    self.master_device = devices[0]
    with tf.device(self.master_device):
      self.model = models.build(config.model, split.input_shape,
                                split.num_classes, precision=config.precision)
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables)
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
    if self.model.non_trainable_variables:
      # Workers send gradients only; state such as batch-norm statistics
      # would stay at its initial value in the master that eval reads.
      raise UserError(
          f"--mode=async trains trainable variables only, and --model="
          f"{config.model} has non-trainable state ("
          f"{self.model.non_trainable_variables[0].path}, ...); use "
          "--mode=sync")
    self.applier = Applier(
        self.model, self.optimizer, self.step, self.master_device,
        max_staleness=config.max_staleness,
        staleness_lr=policies.STALENESS_LR.get(config.staleness_lr),
        compensation=policies.COMPENSATIONS.get(config.async_compensation),
        dc_lambda=config.dc_lambda, loss_scale=self.loss_scale)
    num_workers = self.num_workers(config)
    self.workers = [
        Worker(i, num_workers, devices[i % len(devices)], config.model, split,
               config.global_batch_size, config.seed, config.precision)
        for i in range(num_workers)]
    self.straggler = straggler_lib.parse(config.straggler)
    self._failure_lock = threading.Lock()
    self._threads: List[threading.Thread] = []
    self._new_run()
    self._history_taus: List[int] = []  # Since the last `histograms()`.
    self._train_seconds = 0.0

  def _new_run(self) -> None:
    """Fresh queues and flags: the next `train` starts the threads anew."""
    num_workers = len(self.workers)
    # A worker has at most one push in flight (see `_worker_loop`), so the
    # queue never holds more than W pushes: memory is flat.
    self._pushes: "queue.Queue[Push]" = queue.Queue(maxsize=num_workers)
    self._processed = [threading.Event() for _ in range(num_workers)]
    self._budgets: "queue.Queue[int]" = queue.Queue()
    self._tallies: "queue.Queue[_Tally]" = queue.Queue()
    self._stop = threading.Event()
    self._failure: Optional[WorkerFailed] = None
    self._started = False

  def on_restore(self) -> None:
    """After a rollback: the threads were stopped at the non-finite update;
    pushes computed on the abandoned weights are dropped with the queue, and
    the next `train` restarts the threads, the version and each worker's
    input at the restored step."""
    self.close()
    if self._threads:  # A thread that outlived close() holds the old queues.
      raise RuntimeError("async threads did not stop for the rollback: "
                         + ", ".join(t.name for t in self._threads))
    self._new_run()

  # -- the main thread's side --

  def train(self, num_steps: int) -> Dict[str, float]:
    if self._stop.is_set():
      raise RuntimeError("the async trainer was stopped; build a new one")
    self._start()
    worker_steps = [w.steps for w in self.workers]
    t0 = time.perf_counter()
    try:
      self._budgets.put(num_steps)
      tally = self._wait_for_tally()
    except BaseException:  # Ctrl-C included: stop every thread, then raise.
      self.close()
      raise
    seconds = max(time.perf_counter() - t0, 1e-9)
    if tally.bad_step >= 0:
      self.close()
      raise NonFiniteError(tally.bad_step)
    self._train_seconds += seconds
    self._history_taus.extend(tally.taus)
    n = max(tally.applied, 1)
    metrics = {
        "train/loss": tally.loss / n,
        "train/accuracy": tally.accuracy / n,
        "train/grad_norm": tally.grad_norm / n,
        "train/learning_rate": float(
            tf.convert_to_tensor(self.optimizer.learning_rate)),
        "async/staleness_mean": float(np.mean(tally.taus or [0])),
        "async/staleness_max": float(max(tally.taus or [0])),
        "async/drops_per_update": tally.dropped / n,
        "async/updates_per_sec": tally.applied / seconds,
        "train/skipped_steps": float(tally.skipped),
    }
    if self.loss_scale is not None:
      metrics["train/loss_scale"] = self.applier.current_loss_scale
    for w, before in zip(self.workers, worker_steps):
      metrics[f"async/worker{w.index}_steps_per_sec"] = (
          (w.steps - before) / seconds)
    return metrics

  def _wait_for_tally(self) -> _Tally:
    while True:
      self._raise_failure()
      try:
        return self._tallies.get(timeout=POLL_SECONDS)
      except queue.Empty:
        pass

  def _raise_failure(self) -> None:
    if self._failure is not None:
      failure = self._failure
      self.close()
      raise failure from failure.__cause__

  def _fail(self, thread: str, error: BaseException) -> None:
    with self._failure_lock:
      if self._failure is None:
        failure = WorkerFailed(thread, error)
        failure.__cause__ = error
        self._failure = failure
    self._stop.set()

  def _start(self) -> None:
    """Starts the threads at the first `train`, after any restore."""
    if self._started:
      return
    self._started = True
    self.applier.sync_version()
    start = self.applier.version // len(self.workers)
    self.applier.trace()
    for w in self.workers:
      w.start_input(start)
      w.trace()
    self._threads = [threading.Thread(target=self._guard,
                                      args=(self.workers[i].name,
                                            self._worker_loop, self.workers[i]),
                                      name=f"async-worker-{i}", daemon=True)
                     for i in range(len(self.workers))]
    self._threads.append(threading.Thread(
        target=self._guard, args=("async applier", self._applier_loop),
        name="async-applier", daemon=True))
    for t in self._threads:
      t.start()

  def close(self) -> None:
    """Stops every thread and waits for it (bounded). Safe to call twice."""
    self._stop.set()
    deadline = time.monotonic() + JOIN_SECONDS
    for t in self._threads:
      t.join(timeout=max(deadline - time.monotonic(), 0.0))
    alive = [t.name for t in self._threads if t.is_alive()]
    if alive:  # Daemon threads: they cannot keep the process alive.
      logging.error("async threads still running after %.0f s: %s",
                    JOIN_SECONDS, ", ".join(alive))
    self._threads = [t for t in self._threads if t.is_alive()]

  def threads_alive(self) -> List[str]:
    return [t.name for t in self._threads if t.is_alive()]

  # -- the threads --

  def _guard(self, thread: str, loop, *args) -> None:
    try:
      loop(*args)
    except _Stopped:
      pass
    except BaseException as e:  # pylint: disable=broad-except
      self._fail(thread, e)

  def _worker_loop(self, worker: Worker) -> None:
    processed = self._processed[worker.index]
    while not self._stop.is_set():
      x, y = worker.next_batch()
      version, read, loss_scale = self.applier.read()
      t0 = time.perf_counter()
      push = worker.compute(version, read, x, y, loss_scale)
      if self.straggler is not None:
        straggler_lib.sleep(
            self.straggler.delay(worker.index, time.perf_counter() - t0),
            self._stop)
      # Like a push to a parameter server, the push returns once the applier
      # has dealt with it: only the other workers' updates make a gradient
      # stale, and with one worker async is exactly sequential SGD.
      processed.clear()
      self._put(push)
      self._wait(processed)

  def _applier_loop(self) -> None:
    while True:
      budget = self._get(self._budgets)
      tally = _Tally()
      while tally.applied < budget:
        push = self._get(self._pushes)
        outcome = self.applier.offer(push)
        self._processed[push.worker].set()
        if not outcome.finite:
          tally.bad_step = self.applier.version + 1
          break
        if outcome.applied:
          tally.add(push, outcome.grad_norm, outcome.tau)
        elif outcome.skipped:
          tally.skipped += 1
        else:
          tally.dropped += 1
      self._tallies.put(tally)

  def _put(self, push: Push) -> None:
    while True:
      if self._stop.is_set():
        raise _Stopped()
      try:
        self._pushes.put(push, timeout=POLL_SECONDS)
        return
      except queue.Full:
        pass

  def _wait(self, event: threading.Event) -> None:
    while not event.wait(timeout=POLL_SECONDS):
      if self._stop.is_set():
        raise _Stopped()

  def _get(self, q: queue.Queue):
    while True:
      if self._stop.is_set():
        raise _Stopped()
      try:
        return q.get(timeout=POLL_SECONDS)
      except queue.Empty:
        pass

  # -- what the controller logs besides the train metrics --

  def log_scalars(self) -> Dict[str, float]:
    return {"async/dropped": float(self.applier.dropped),
            "async/skipped": float(self.applier.skipped),
            "async/applied": float(self.applier.applied)}

  def histograms(self) -> Dict[str, np.ndarray]:
    taus, self._history_taus = self._history_taus, []
    if not taus:
      return {}
    return {"async/staleness": np.asarray(taus, np.float32)}

  def extra_summary(self) -> Dict[str, object]:
    counts = self.applier.staleness_counts
    applied = sum(counts.values())
    mean = (sum(t * c for t, c in counts.items()) / applied if applied
            else None)
    return {
        "async_workers": len(self.workers),
        "async_applied": applied,
        "async_dropped": self.applier.dropped,
        "async_skipped": self.applier.skipped,
        "async_staleness_mean": mean,
        "async_staleness_max": max(counts) if counts else None,
        "async_staleness_counts": {str(t): counts[t] for t in sorted(counts)},
        "async_updates_per_sec": (applied / self._train_seconds
                                  if self._train_seconds else None),
    }
