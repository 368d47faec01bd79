"""Parameter-server async training: ParameterServerStrategy + coordinator.

The cluster (TF_CONFIG, see `dist_loop.cluster` and `tools/launch.py`) has a
chief, W workers and P parameter servers. Workers and parameter servers are
plain `tf.distribute.Server`s (`join_cluster` serves and never returns); the
chief is the coordinator and the only process that runs this loop:

    chief: train(n)   target = step + n
      schedule ceil(remaining / K) calls of `_loop(iterator)`,
      join, repeat until step == target            (K = --ps_steps_per_call)
    worker (whichever the coordinator picks), one step of `_loop`:
      v   = step                       the version read at the start
      g   = grad(batch, weights read from the PSs)
      under the PS lock:
        tau = step - v                 the version at apply, minus v
        drop if tau > --max_staleness  (and count it), else
        apply g and step += 1 if step < target (else the budget is spent)

The version is the number of applied updates, i.e. `step`, as in
`--mode=async`: dropped gradients do not advance it, so after every applied
update the next gradient read at the new version is fresh, and the run makes
progress for any bound and any W. ParameterServerStrategy has no staleness
bound of its own; this is it.

The lock. Deciding and applying must be one atomic step: without it, two
workers can both find tau within the bound and both apply, and the second
is then staler than the bound allows (a trial without the lock applied
updates 4 versions stale under --max_staleness=0). So the decision, the
optimizer update and the step increment run in a `tf.CriticalSection` whose
mutex lives on the PS next to `step`. Its ops run on the PSs only, after the
gradients have arrived there, so a worker that dies mid-step cannot hold
it; a PS that dies takes the whole state with it anyway (see Faults).
Weights are read without the lock, like any PS reader: a read may see part
of an update in flight, but never misses one counted before its `v`,
because `step` moves after the update. Updates are serialised, as the async
mode's applier is; the gradients are computed in parallel.

Counting. Concurrent read-modify-write counters lose increments: the Keras
optimizer's `iterations` missed 352 of 500 updates in a trial without the
lock. `step` moves only under the lock, so it counts applied updates
exactly. The step's statistics (applied, dropped, skipped, staleness
histogram, loss sums) are added to a PS vector `_stats` under the same
lock, in this order: weights (with the optimizer's counter), then `step`,
then `_stats`. A worker killed while its step holds the lock (or a call
the coordinator abandons and re-runs) cancels the rest of that step's ops:
the lock is released, and at most that one update is left part-done
(weights moved but not `step`, or `step` but not `_stats`). A trial that recorded `_stats` first, in parallel with the
update, once ended with 401 recorded updates for 400 counted.

The chief never copies a result from a worker: a scheduled call returns
nothing, and the chief reads `step` and `_stats` from the PSs between
rounds, while no call runs. Every copy from a worker is one more remote op
from one of the coordinator's threads, concurrent with the others, and such
a copy failed once in CI ("Unable to parse request" from the worker's
server, TF 2.21): the fewer concurrent remote ops, the fewer chances.

Mixed precision: with float16, the loss scale is a PS variable; a worker
reads it with `v`, differentiates loss * scale and unscales, and the
overflow rule of `--mode=async` is applied under the lock
(`_answer_overflow`).

Data: each worker has its own dataset (`create_per_worker_dataset`). The
dataset function is traced once and runs on every worker, so it draws its
shard id from a PS counter (fetch_add again): worker shards are disjoint
slices of the same global stream as the other modes (`train_dataset_fn`).

Faults: the coordinator re-runs a lost worker's calls on the others, so a
killed worker only slows training (and may leave its one update in the
lock part-done, see Counting). A lost parameter server loses variables:
training stops with `ClusterError`, and rerunning the command on a restarted
cluster resumes from the last checkpoint.
"""

import math
import os
import sys
import time
from typing import Dict

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from dist_loop import cluster as cluster_lib
from dist_loop.cluster import ClusterError
from dist_loop import models, optim
from dist_loop import strategy as strategy_lib
from dist_loop import precision as precision_lib
from dist_loop.modes.asynchronous import policies
from dist_loop.data import train_dataset_fn
from dist_loop.errors import NonFiniteError, UserError
from dist_loop.modes.base import MODES, Trainer

TAU_BINS = 64  # Staleness histogram bins; the last one holds tau >= 63.
# The layout of `_stats`: counts, the staleness histogram of applied
# updates, then sums over applied updates.
_COUNTS = ("applied", "dropped", "skipped", "nonfinite")
_SUMS = ("loss", "accuracy", "grad_norm")
_NUM_STATS = len(_COUNTS) + TAU_BINS + len(_SUMS)
_INT64_MAX = 2**63 - 1
_JOIN_POLL_S = 0.1


def fetch_add(variable: tf.Variable) -> tf.Tensor:
  """Atomically adds 1 to an int64 resource variable; returns the old value.

  `assign_add(1)` followed by a read is two ops, so two workers can read the
  same value; `ResourceCountUpTo` increments and returns under the
  variable's own mutex. (The input shards are numbered with it.)
  """
  return tf.raw_ops.ResourceCountUpTo(resource=variable.handle,
                                      limit=_INT64_MAX, T=tf.int64)


def _serve(cluster: cluster_lib.Cluster, config) -> None:
  """Runs this worker or parameter server until the process is stopped."""
  # A server runs one op per concurrent remote call; with fewer inter-op
  # threads than workers + 1 the cluster can deadlock (seen in-process).
  threads = max(config.inter_op_threads, cluster.num_workers + 1)
  server = tf.distribute.Server(
      tf.train.ClusterSpec(cluster.as_dict()), job_name=cluster.task_type,
      task_index=cluster.task_index, protocol="grpc",
      config=tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads),
      start=True)
  logging.info("serving %s at %s until stopped", cluster.task_name,
               server.target)
  try:
    server.join()
  except KeyboardInterrupt:
    sys.exit(130)


@MODES.register("ps")
class PSTrainer(Trainer):
  """The coordinator's side: schedules K-step calls on the workers."""

  multi_process = True
  precisions = precision_lib.PRECISIONS  # float16: see _decide_and_apply.

  @classmethod
  def num_replicas(cls, config) -> int:
    return 1  # A step is one worker's batch of --global_batch_size examples.

  @classmethod
  def validate_config(cls, config) -> None:
    super().validate_config(config)
    cluster = cluster_lib.current()
    if not (cluster.num_ps and cluster.num_workers
            and cluster_lib.CHIEF in cluster.spec):
      raise UserError(
          "--mode=ps needs a cluster of a chief, workers and parameter "
          "servers: run it as python -m tools.launch --num_workers=2 "
          "--num_ps=1 -- python -m experiments.train ..., or give each "
          "host a TF_CONFIG (README, 'Multiple processes and hosts')")
    if config.num_devices != 1:
      raise UserError(f"--num_devices={config.num_devices}: --mode=ps runs "
                      "one replica per worker; use --num_devices=1")
    if config.max_staleness < policies.NO_BOUND:
      raise UserError(f"--max_staleness must be >= 0, or -1 for no bound; "
                      f"got {config.max_staleness}")
    for name in ("staleness_lr", "async_compensation"):
      if getattr(config, name) != "none":
        raise UserError(f"--{name} is a --mode=async policy; --mode=ps "
                        f"bounds staleness with --max_staleness only: use "
                        f"--{name}=none")
    if config.straggler:
      raise UserError("--straggler is for --mode=sync and --mode=async; "
                      "slow a ps worker down outside dist_loop")

  @classmethod
  def join_cluster(cls, config) -> None:
    # TensorFlow's advice for PS training: a failed RPC fails the call at
    # once instead of waiting for the peer, so worker failures are detected.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    cluster = cluster_lib.current()
    if cluster.task_type in (cluster_lib.WORKER, cluster_lib.PS):
      _serve(cluster, config)

  def __init__(self, config, devices, split):
    super().__init__(config, devices, split)
    cluster = cluster_lib.current()
    self.num_workers = cluster.num_workers
    self.strategy = tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.TFConfigClusterResolver())
    self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
        self.strategy)
    with self.strategy.scope():  # Every variable lives on a PS.
      self.model = models.build(config.model, split.input_shape,
                                split.num_classes, precision=config.precision)
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables)
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False,
                              name="step")
      self._shard_counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name="input_shards")
      self._target = tf.Variable(0, dtype=tf.int64, trainable=False,
                                 name="step_budget")
      self._stats = tf.Variable(tf.zeros([_NUM_STATS], tf.float64),
                                trainable=False, name="round_stats")
    with tf.device(self.step.device):  # The lock lives with the counter.
      self._lock = tf.CriticalSection(name="ps_update")
    self._iterator = None
    self._start_step = 0  # Where the workers' input starts (set at resume).
    self._loop = tf.function(self._loop_fn)
    self._tau_counts = np.zeros(TAU_BINS, np.int64)  # Whole run.
    self._tau_window = np.zeros(TAU_BINS, np.int64)  # Since the last log.
    self._dropped = 0
    self._skipped = 0
    self._applied_start = None
    self._train_seconds = 0.0

  def scope(self):
    return self.strategy.scope()

  # -- on a worker: K steps per scheduled call --

  def _dataset_fn(self):
    """Worker k of W reads input pipeline k of the global stream."""
    shard = fetch_add(self._shard_counter) % self.num_workers
    context = tf.distribute.InputContext(
        num_input_pipelines=self.num_workers, input_pipeline_id=shard,
        num_replicas_in_sync=self.num_workers)
    fn = train_dataset_fn(
        self.split.train_x, self.split.train_y,
        self.config.global_batch_size * self.num_workers, self.config.seed,
        start_step=self._start_step // self.num_workers)
    return fn(context)

  def _replica_step(self, x, y):
    """The gradient of one batch, the version `v` it was read at and, with
    float16, the loss scale it was computed at (unscaled here)."""
    variables = self.model.trainable_variables
    # Read v after this step's batch arrived (loop-variant, so the read is
    # never hoisted out of the step loop) and before the weights.
    with tf.control_dependencies([x, y]):
      read_version = self.step.read_value()
    with tf.control_dependencies([read_version]):
      scale = (tf.constant(1.0) if self.loss_scale is None
               else self.loss_scale.scale.read_value())
      with tf.GradientTape() as tape:
        logits = tf.cast(self.model(x, training=True), tf.float32)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, logits, from_logits=True))
        if self.model.losses:
          loss += tf.add_n(self.model.losses)
        scaled = loss if self.loss_scale is None else loss * scale
      grads = tape.gradient(scaled, variables)
      if self.loss_scale is not None:
        grads = [g / scale for g in grads]
    correct = tf.reduce_mean(tf.cast(
        tf.equal(tf.argmax(logits, -1, output_type=tf.int32),
                 tf.cast(y, tf.int32)), tf.float32))
    return {"grads": grads, "read_version": read_version, "loss": loss,
            "loss_scale": scale, "accuracy": correct,
            "grad_norm": tf.linalg.global_norm(grads)}

  def _decide_and_apply(self, grads, read_version, target, loss, loss_scale,
                        accuracy, grad_norm):
    """Applies `grads` if they are finite, fresh enough and within budget,
    and records the outcome in `_stats`.

    Runs under the PS lock (see the module docstring), in cross-replica
    context: a lock taken inside `strategy.run` would be held across the
    replica thread's `merge_call` hand-off, which deadlocks tracing.

    With float16, non-finite gradients of a finite loss are an overflow,
    handled as in `--mode=async` (asynchronous/applier.py): the gradient is
    skipped, and the scale halves only if the gradient was computed at the
    scale in force or a smaller one (not at an older, larger scale that
    was already halved); at the floor scale 1.0 it is a real non-finite
    step (`precision.stale_overflow`). Each applied update counts a good
    step towards the scale's growth.
    """
    finite = optim.all_finite(grads)

    def locked():
      # Nothing else moves `step` while this runs, so tau is exact. Every op
      # here is on the PSs: the lock never waits on a worker.
      now = self.step.read_value()
      tau = now - read_version
      fresh = (tf.constant(self.config.max_staleness < 0)
               | (tau <= self.config.max_staleness))
      apply = finite & fresh & (now < target)
      applied = optim.apply_reduced(self.optimizer, grads,
                                    self.model.trainable_variables, apply)
      with tf.control_dependencies([applied]):  # Count after the update.
        counted = self.step.assign_add(tf.cast(apply, tf.int64))
      skipped = self._answer_overflow(finite, apply, loss, loss_scale)
      out = {"applied": apply, "dropped": finite & ~fresh,
             "skipped": skipped, "nonfinite": ~finite & ~skipped}
      # The histogram and the sums hold applied updates only; `where`, not
      # `0 *`: a skipped overflow's grad_norm is inf, and 0 * inf is NaN.
      of_applied = tf.concat([
          tf.one_hot(tf.minimum(tau, TAU_BINS - 1), TAU_BINS,
                     dtype=tf.float64),
          tf.cast(tf.stack([loss, accuracy, grad_norm]), tf.float64)], 0)
      with tf.control_dependencies([counted]):  # Record after the count.
        recorded = self._stats.assign_add(tf.concat([
            tf.cast(tf.stack([out[k] for k in _COUNTS]), tf.float64),
            tf.where(apply, of_applied, tf.zeros_like(of_applied))], 0))
      with tf.control_dependencies([recorded]):
        return {**out, "tau": tf.identity(tau), "step": counted.read_value()}

    with tf.device(self.step.device):
      return self._lock.execute(locked)

  def _answer_overflow(self, finite, applied, loss, loss_scale):
    """Moves the float16 loss scale; returns whether a non-finite gradient
    is an overflow to skip. Without loss scaling it never is."""
    if self.loss_scale is None:
      return tf.constant(False)
    skip, halve = precision_lib.stale_overflow(
        finite, tf.math.is_finite(loss), loss_scale,
        self.loss_scale.scale.read_value())

    def update():
      self.loss_scale.update(applied)
      return tf.constant(True)

    moved = tf.cond(applied | halve, update, lambda: tf.constant(False))
    with tf.control_dependencies([moved]):
      return tf.identity(skip)

  def _loop_fn(self, iterator):
    """Up to K steps on this worker. Returns nothing: what happened is in
    `step` and `_stats`, on the PSs (see "The chief never copies")."""
    target = self._target.read_value()
    for _ in tf.range(self.config.ps_steps_per_call):
      if self.step.read_value() >= target:
        break
      x, y = next(iterator)
      out = self.strategy.run(self._replica_step, args=(x, y))
      out = tf.nest.map_structure(
          lambda v: self.strategy.experimental_local_results(v)[0], out)
      self._decide_and_apply(out["grads"], out["read_version"], target,
                             out["loss"], out["loss_scale"], out["accuracy"],
                             out["grad_norm"])

  # -- on the chief --

  def train(self, num_steps: int) -> Dict[str, float]:
    start = int(self.step.numpy())
    if self._applied_start is None:
      self._applied_start = start
    if self._iterator is None:  # Built lazily: resumes at the restored step.
      self._start_step = start
      dataset = self.coordinator.create_per_worker_dataset(self._dataset_fn)
      self._iterator = iter(dataset)
    target = start + num_steps
    # The budget reaches the workers through a PS variable, set while no call
    # runs: a scheduled call's only argument is its worker's iterator.
    self._target.assign(target)
    self._stats.assign(tf.zeros_like(self._stats))
    totals = dict.fromkeys(_COUNTS + _SUMS, 0.0)
    taus = np.zeros(TAU_BINS, np.int64)
    t0 = time.perf_counter()
    step = start
    while step < target:
      calls = math.ceil((target - step) / self.config.ps_steps_per_call)
      try:
        for _ in range(calls):
          self.coordinator.schedule(self._loop, args=(self._iterator,))
        self._wait(step)
      except KeyboardInterrupt:
        # Let the scheduled calls finish first, so the checkpoint the
        # controller saves next is of still variables at the step it names.
        self._wait(step)
        raise
      totals, taus = self._read_stats()
      if totals["nonfinite"]:
        raise NonFiniteError(int(self.step.numpy()) + 1)
      step = int(self.step.numpy())
    seconds = max(time.perf_counter() - t0, 1e-9)
    self._train_seconds += seconds
    self._dropped += int(totals["dropped"])
    self._skipped += int(totals["skipped"])
    self._tau_counts += taus
    self._tau_window += taus
    n = max(int(totals["applied"]), 1)
    values = np.arange(TAU_BINS)
    metrics = {
        "train/loss": totals["loss"] / n,
        "train/accuracy": totals["accuracy"] / n,
        "train/grad_norm": totals["grad_norm"] / n,
        "train/learning_rate": float(
            tf.convert_to_tensor(self.optimizer.learning_rate)),
        "ps/staleness_mean": float((values * taus).sum() / max(taus.sum(), 1)),
        "ps/staleness_max": float(values[taus > 0].max() if taus.any()
                                  else 0),
        "ps/drops_per_update": int(totals["dropped"]) / n,
        "ps/updates_per_sec": num_steps / seconds,
        "train/skipped_steps": int(totals["skipped"]),
    }
    if self.loss_scale is not None:
      metrics["train/loss_scale"] = float(self.loss_scale.scale.numpy())
    return metrics

  def _read_stats(self):
    """This `train` call's counts and sums, and its staleness histogram."""
    stats = self._stats.numpy()
    values = dict(zip(_COUNTS + _SUMS, np.concatenate(
        [stats[:len(_COUNTS)], stats[len(_COUNTS) + TAU_BINS:]]).tolist()))
    taus = stats[len(_COUNTS):len(_COUNTS) + TAU_BINS].astype(np.int64)
    return values, taus

  def _wait(self, step: int) -> None:
    """`coordinator.join()`, bounded by --collective_timeout_s per round.

    Polls `coordinator.done()`, which runs no TensorFlow op: the main thread
    stays out of the eager runtime while the coordinator's threads use it
    (concurrent remote ops from here corrupted a request in a trial). A
    lost worker's calls are re-run on the others, so a round only stalls if
    every worker is lost; a lost PS makes `done()` raise.
    """
    deadline = time.monotonic() + self.config.collective_timeout_s
    while not self.coordinator.done():
      if time.monotonic() > deadline:
        raise ClusterError(
            f"a round of scheduled calls from step {step} did not finish "
            f"within --collective_timeout_s={self.config.collective_timeout_s:g}"
            f": are all {self.num_workers} workers down? Restart them and "
            "rerun the command to resume from the last checkpoint")
      time.sleep(_JOIN_POLL_S)
    self.coordinator.join()  # Returns at once; raises a call's error.

  @classmethod
  def cluster_error(cls, config, error):
    """A lost PS (or every worker) anywhere in the run: building the
    variables, a step, a checkpoint, an evaluation, a read of `step`."""
    if not isinstance(error, strategy_lib.LOST_TASK_ERRORS):
      return None
    return ClusterError(
        f"a parameter server is unreachable ({cluster_lib.describe(error)}); "
        "its variables are lost. Restart the cluster and "
        "rerun the same command: training resumes from the last checkpoint "
        f"in {config.workdir}")

  # -- what the controller logs besides the train metrics --

  def log_scalars(self) -> Dict[str, float]:
    return {"ps/dropped": float(self._dropped),
            "ps/applied": float(int(self.step.numpy()) - self._applied_start
                                if self._applied_start is not None else 0)}

  def histograms(self) -> Dict[str, np.ndarray]:
    counts, self._tau_window = self._tau_window, np.zeros(TAU_BINS, np.int64)
    if not counts.any():
      return {}
    return {"ps/staleness": np.repeat(np.arange(TAU_BINS),
                                      counts).astype(np.float32)}

  def extra_summary(self) -> Dict[str, object]:
    counts = self._tau_counts
    applied = int(counts.sum())
    values = np.arange(TAU_BINS)
    return {
        "ps_workers": self.num_workers,
        # PSS places whole variables round-robin over the servers.
        "ps_servers_holding_weights": len(
            {v.value.device for v in self.model.trainable_variables}),
        "ps_applied": (int(self.step.numpy()) - self._applied_start
                       if self._applied_start is not None else 0),
        "ps_dropped": self._dropped,
        "ps_skipped": self._skipped,
        "ps_max_staleness": self.config.max_staleness,
        "ps_staleness_mean": (float((values * counts).sum() / applied)
                              if applied else None),
        "ps_staleness_max": int(values[counts > 0].max()) if applied else None,
        "ps_staleness_counts": {str(t): int(c) for t, c in enumerate(counts)
                                if c},
        # For comparison only: `step` is what counts (see the docstring).
        "ps_optimizer_iterations": int(np.asarray(self.optimizer.iterations)),
        "ps_updates_per_sec": (applied / self._train_seconds
                               if self._train_seconds else None),
    }
