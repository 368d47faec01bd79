"""Asynchronous data parallelism: worker threads, one applier, stale gradients.

TensorFlow has no in-process asynchronous strategy, so this mode is threads
(session.py): W workers, each with its own device, model copy and input
shard, push gradients computed on the master weights they read; one applier
applies them to the master as they come, with the staleness policies. The
step logic itself (`Worker.compute`, `Applier.offer`) has no threads, so
tests can force any interleaving.

`input_wait_s` is the mean over workers of the time their `next_batch`
waited during the call: each worker waits for its own input while the
others' steps go on.

Each push is the gradient of one worker's batch of `--global_batch_size`
examples, so an applied update sees as many examples as a sync step does,
and `train(n)` applies n updates: dropped (too stale) and skipped (float16
overflow) pushes are not updates, and are reported under `async/`.

`--precision=mixed_float16` scales the loss dynamically, as sync mode does,
but the scale travels with each push instead of being in an all-reduce: the
applier owns the scale (checkpointed as "loss_scale", as in sync mode), and
a worker computes at the scale it read (worker.py, applier.py).
"""

import time
from typing import Dict, List, Optional

import tensorflow as tf

from dist_loop import models
from dist_loop.core.errors import NonFiniteError, UserError
from dist_loop.parallel import staleness
from dist_loop.parallel import straggler as straggler_lib
from dist_loop.parallel.modes.asynchronous import policies
from dist_loop.parallel.modes.asynchronous.applier import Applier
from dist_loop.parallel.modes.asynchronous.options import AsyncOptions
from dist_loop.parallel.modes.asynchronous.session import Session
from dist_loop.parallel.modes.asynchronous.worker import Worker
from dist_loop.runtime import user_code
from dist_loop.training import optim
from dist_loop.training import precision as precision_lib
from dist_loop.parallel.modes.base import (MODES, Report, Reporting, Trainer,
                                  train_metrics)


@MODES.register("async")
class AsyncTrainer(Trainer, Reporting):
  """Stale-gradient SGD with W worker threads and one applier thread."""

  Options = AsyncOptions
  precisions = precision_lib.PRECISIONS
  checks_max_loss = True

  # -- before TensorFlow starts --

  @classmethod
  def num_replicas(cls, config, cluster) -> int:
    del config, cluster
    return 1  # Every worker computes on the whole --global_batch_size.

  @classmethod
  def num_workers(cls, config) -> int:
    """--async_workers, or one worker per device when it is 0."""
    return config.mode_options.async_workers or config.num_devices

  @classmethod
  def input_pipelines(cls, config, cluster) -> int:
    del cluster
    return cls.num_workers(config)  # Each worker reads its own (worker.py).

  @classmethod
  def validate(cls, config, cluster) -> None:
    super().validate(config, cluster)
    straggler_lib.check(config.mode_options.straggler,
                        cls.num_workers(config), "async workers")

  # -- building --

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    options = self.options
    self.master_device = devices[0]
    with tf.device(self.master_device):
      self.model = models.build_for(config, dataset)
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables,
                                  config.weight_decay)
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
        max_staleness=options.max_staleness,
        staleness_lr=policies.STALENESS_LR.get(options.staleness_lr),
        compensation=user_code.convert(  # An extension's: AutoGraph.
            policies.COMPENSATIONS.get(options.async_compensation)),
        dc_lambda=options.dc_lambda, loss_scale=self.loss_scale,
        max_loss=config.max_loss, recipe=self.recipe)
    self.workers = self._make_workers(config, devices, dataset)
    self.straggler = straggler_lib.parse(options.straggler)
    self._session: Optional[Session] = None
    self._closed = False
    self._since_report = staleness.Histogram()

  def _make_workers(self, config, devices, dataset) -> List[Worker]:
    """One worker per thread, round robin over the devices."""
    num_workers = self.num_workers(config)
    workers = []
    for i in range(num_workers):
      device = devices[i % len(devices)]
      with tf.device(device):
        model = models.build_for(config, dataset)
      workers.append(Worker(
          i, num_workers, device, model, self.task, dataset,
          config.global_batch_size, config.seed,
          loss_scaled=precision_lib.needs_loss_scale(config.precision),
          jit_compile=config.jit_compile))
    return workers

  # -- the main thread's side --

  def train(self, num_steps: int) -> Dict[str, float]:
    if self._closed:
      raise RuntimeError("the async trainer was closed; build a new one")
    if self._session is None:  # The first call, or the first after a restore.
      session = Session(self.applier, self.workers, self.straggler)
      session.start()
      self._session = session
    worker_steps = [w.steps for w in self.workers]
    waits = [w.input_s for w in self.workers]
    t0 = time.perf_counter()
    try:
      tally = self._session.run(num_steps)
    except BaseException:  # Ctrl-C included: stop every thread, then raise.
      self.close()
      raise
    seconds = max(time.perf_counter() - t0, 1e-9)
    # The workers' waits overlap each other's steps: their mean share.
    self.input_wait_s = min(sum(w.input_s - before for w, before in zip(
        self.workers, waits)) / len(self.workers), seconds)
    if tally.bad_step >= 0:
      self._end_session()  # The next `train` follows a rollback.
      raise NonFiniteError(tally.bad_step)
    self._since_report.merge(tally.taus)
    # Only applied updates are steps, so no step is ever skipped: a skipped
    # push (float16 overflow) is `async/skipped_pushes`.
    extra = ({"loss_scale": self.applier.current_loss_scale}
             if self.loss_scale is not None else {})
    metrics = train_metrics(self.task, tally.means(), extra=extra)
    metrics.update(tally.taus.scalars("async"))
    metrics["async/drops_per_update"] = tally.dropped / max(tally.applied, 1)
    for w, before in zip(self.workers, worker_steps):
      metrics[f"async/worker{w.index}_steps_per_sec"] = (
          (w.steps - before) / seconds)
    return metrics

  def on_restore(self) -> None:
    """After a rollback: whatever stopped the threads (the non-finite
    update, `close`), the next `train` starts new ones, with the version and
    each worker's input at the restored step."""
    self._closed = False
    alive = self._end_session()
    if alive:  # They would still compute on the abandoned weights.
      raise RuntimeError("async threads did not stop for the rollback: "
                         + ", ".join(alive))

  def close(self) -> None:
    """Stops every thread (bounded; a thread that outlives it is logged),
    then frees the workers' input. Safe to call twice."""
    self._closed = True
    if not self._end_session():  # A live thread may still be reading.
      for w in self.workers:
        w.stop_input()

  def _end_session(self) -> List[str]:
    """Stops the threads; returns the names of any still running."""
    session, self._session = self._session, None
    return session.close() if session is not None else []

  # -- reporting --

  def report(self) -> Report:
    """Running totals, and the staleness of the updates since the last
    report as a histogram."""
    since, self._since_report = self._since_report, staleness.Histogram()
    histograms = {"async/staleness": since.samples()} if since.total else {}
    return Report(scalars={
        "async/applied": float(self.applier.applied),
        "async/dropped": float(self.applier.dropped),
        "async/skipped_pushes": float(self.applier.skipped)},
        histograms=histograms)

  def summary(self) -> Dict[str, object]:
    return {"async_workers": len(self.workers),
            "async_applied": self.applier.applied,
            "async_dropped": self.applier.dropped,
            "async_skipped_pushes": self.applier.skipped,
            **self.applier.staleness.summary("async")}
