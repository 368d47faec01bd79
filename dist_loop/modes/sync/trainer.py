"""Synchronous data parallelism: MirroredStrategy and one explicit all-reduce.

Each replica differentiates its share of the step's mean loss (the step
core, `dist_loop/step.py`: a replica's `grad_accum_steps` micro-batches are
`replicas x grad_accum_steps` contributors), so that the SUM over replicas
of its gradients is the gradient of the global-batch mean. The gradients are
all-reduced exactly once, in replica context, by the run's compressor
(`--allreduce_compression`, `dist_loop/compression`), and applied with
`optim.apply_reduced`, which does not reduce again. `steps_per_loop` steps
run inside one `tf.function` call (`step.run_steps`), so the host is
visited once per loop.

A compressor with state (error feedback) keeps it per replica and writes it
only when the step is applied; it is the checkpoint's `compression` entry,
so without one the checkpoint holds what it always did. Such a compressor
gets unscaled gradients (a residual outlives the loss scale it was computed
under). A compressor's warm-up (`exact_steps`) is a `tf.cond` around
`strategy.run`: a collective may not sit inside control flow within it.
"""

import time
from typing import Dict

import tensorflow as tf

from dist_loop import compression, models, optim
from dist_loop import cluster as cluster_lib
from dist_loop import devices as devices_lib
from dist_loop import precision as precision_lib
from dist_loop import step as step_lib
from dist_loop import straggler as straggler_lib
from dist_loop import strategy as strategy_lib
from dist_loop.data import train_dataset_fn
from dist_loop.errors import NonFiniteError, UserError
from dist_loop.modes.base import MODES, Report, Reporting, Trainer
from dist_loop.modes.sync.options import SyncOptions


def make_strategy(devices, collective_timeout_s: float = 120.0,
                  num_trainers: int = 1) -> tf.distribute.Strategy:
  """The one place sync mode picks its strategy.

  * several training processes (`num_trainers`, from TF_CONFIG): the process's
    MultiWorkerMirroredStrategy (built by `join_cluster` at start-up), whose
    replicas are every worker's devices and whose collectives fail after
    `collective_timeout_s`;
  * otherwise MirroredStrategy over `devices`; one device still goes through
    it, so the 1-device run exercises the very same code path as the
    N-device one.

  Either way the step below is the same: one explicit all-reduce.
  """
  if num_trainers > 1:
    return strategy_lib.multi_worker(collective_timeout_s)
  return strategy_lib.mirrored(devices)


def check_workers_only(config, cluster) -> None:
  """The cluster rules of a mode that runs MultiWorkerMirroredStrategy
  across processes (sync, local_sgd). Raises UserError."""
  if cluster.num_ps:
    raise UserError("TF_CONFIG has parameter servers ('ps' tasks); use "
                    f"--mode=ps, or a cluster of workers only for "
                    f"--mode={config.mode}")
  if (cluster.num_trainers > 1 and config.num_devices > 1
      and devices_lib.resolve_device_type(config.device_type) == "cpu"):
    raise UserError(
        f"--num_devices={config.num_devices}: MultiWorkerMirroredStrategy "
        "runs one replica per worker on CPU; use --num_devices=1 and more "
        "workers")


@MODES.register("sync")
class SyncTrainer(Trainer, Reporting):
  """`strategy.run(replica_step)` inside a `tf.function` loop."""

  Options = SyncOptions
  multi_process = True
  precisions = precision_lib.PRECISIONS
  grad_accumulation = True
  skips_nonfinite = True
  checks_max_loss = True

  @classmethod
  def num_replicas(cls, config, cluster):
    # Multi-worker: every training process contributes its devices.
    return config.num_devices * max(cluster.num_trainers, 1)

  @classmethod
  def validate(cls, config, cluster):
    check_workers_only(config, cluster)
    super().validate(config, cluster)
    straggler_lib.check(config.mode_options.straggler,
                        cls.num_replicas(config, cluster), "replicas")
    compression.check_options(config.mode_options)

  @classmethod
  def join_cluster(cls, config, cluster):
    if cluster.num_trainers > 1:
      strategy_lib.multi_worker(config.collective_timeout_s)

  @classmethod
  def cluster_error(cls, config, cluster, error):
    if (not isinstance(error, strategy_lib.LOST_TASK_ERRORS)
        or cluster.num_trainers <= 1):
      return None
    return cluster_lib.ClusterError(
        f"a peer worker failed or is unreachable "
        f"({cluster_lib.describe(error)}); every collective gives up after "
        f"--collective_timeout_s={config.collective_timeout_s:g}. "
        "Restart every worker with the same command: training resumes from "
        "the last checkpoint")

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    self.is_chief = cluster.is_chief
    self.strategy = make_strategy(devices, config.collective_timeout_s,
                                  cluster.num_trainers)
    replicas = self.strategy.num_replicas_in_sync
    if replicas != self.num_replicas(config, cluster):
      raise UserError(
          f"the strategy has {replicas} replicas but --num_devices="
          f"{config.num_devices} on each of {cluster.num_trainers} workers "
          f"asks for {self.num_replicas(config, cluster)}; make every worker "
          "see --num_devices devices")
    # Every micro-batch of every replica is one share of the step.
    self.contributors = replicas * config.grad_accum_steps
    with self.strategy.scope():
      self.model = models.build_for(config, dataset)
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables)
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
      self.step = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="step",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    variables = self.model.trainable_variables
    self.compressor = compression.make(self.options, variables, config.seed)
    self.exact = compression.COMPRESSORS.get("none")(self.options, variables)
    self.compression_state = compression.State(
        self.strategy, self.compressor.initial_state())
    self.float32_bytes = compression.wire.float32_bytes_per_step(variables)
    self.trace_count = 0
    self.straggler = straggler_lib.parse(self.options.straggler)
    self._iterator = None
    self._on_master_fns = {}
    self._loop = tf.function(self._loop_fn)

  def checkpoint_items(self):
    items = super().checkpoint_items()
    if self.compression_state:
      items["compression"] = self.compression_state.checkpoint
    return items

  def on_restore(self):
    self._iterator = None  # Rebuilt from the restored step.

  def close(self):
    # Free the multi-device input iterator now, while its threads can still
    # finish: destroyed at interpreter exit it can block for minutes.
    self._iterator = None

  def scope(self):
    return self.strategy.scope()

  def on_master(self, fn, *args):
    return strategy_lib.on_first_replica(self.strategy, self._on_master_fns,
                                         fn, *args)

  # -- the replica step: a function of (batch) on the replica's variables --

  def _replica_step(self, x, y, compressor):
    variables = self.model.trainable_variables
    scale = self.loss_scale.scale if self.loss_scale is not None else None
    shares, grads = step_lib.accumulated_gradients(
        self.task, self.model, x, y, chunks=self.config.grad_accum_steps,
        examples_per_update=self.examples_per_step,
        contributors=self.contributors, scale=scale)
    grads = [tf.convert_to_tensor(g) for g in grads]  # Embeddings: dense.
    # The warm-up's exact sum (`self.exact`) neither reads nor moves it.
    stateful = compressor is self.compressor and bool(self.compression_state)
    state = self.compression_state.read() if stateful else {}
    if stateful and scale is not None:  # Residuals outlive the loss scale.
      grads, scale = [g / scale for g in grads], None
    grads, state = compressor.reduce(grads, state, self.step.read_value())
    grads, ok = precision_lib.unscale_and_apply(
        self.optimizer, grads, variables, self.loss_scale, scale)
    if stateful:
      self.compression_state.write(state, ok)
    return shares, tf.linalg.global_norm(grads), ok

  # -- the inner loop: num_steps steps in one tf.function call --

  def _step_fn(self, batch):
    exact_steps = self.compressor.exact_steps
    if not exact_steps:
      return self._run_step(batch, self.compressor)
    return tf.cond(self.step < exact_steps,
                   lambda: self._run_step(batch, self.exact),
                   lambda: self._run_step(batch, self.compressor))

  def _run_step(self, batch, compressor):
    s = self.strategy
    shares, grad_norm, ok = s.run(self._replica_step,
                                  args=(*batch, compressor))
    metrics = {k: s.reduce(tf.distribute.ReduceOp.SUM, v, axis=None)
               for k, v in shares.items()}
    metrics["grad_norm"] = s.reduce(tf.distribute.ReduceOp.MEAN, grad_norm,
                                    axis=None)
    # `ok` follows the all-reduce, so every replica has the same.
    return metrics, s.experimental_local_results(ok)[0], ()

  def _loop_fn(self, iterator, num_steps):
    self.trace_count += 1  # Python side effect: runs once per trace.
    means, bad_step, _ = step_lib.run_steps(
        self._step_fn, iterator, num_steps, self.step,
        keys=self.task.metric_names + ("grad_norm",),
        nonfinite=self.config.nonfinite, loss_scale=self.loss_scale,
        max_loss=self.config.max_loss)
    return means, bad_step

  def train(self, num_steps: int) -> Dict[str, float]:
    self.compression_state.apply()  # After a restore: each replica's own.
    if self._iterator is None:  # Built lazily: resumes at the restored step.
      fn = train_dataset_fn(self.dataset.train_x, self.dataset.train_y,
                            self.examples_per_step, self.config.seed,
                            start_step=int(self.step.numpy()))
      self._iterator = iter(self.strategy.distribute_datasets_from_function(fn))
    t0, traces = time.perf_counter(), self.trace_count
    means, bad_step = self._loop(self._iterator,
                                 tf.constant(num_steps, tf.int64))
    if int(bad_step) >= 0:
      raise NonFiniteError(int(bad_step))
    if self.straggler is not None and self.trace_count == traces:
      # A sync step waits for its slowest replica, so one straggler slows
      # every step; tracing time is not compute, so a traced call is skipped.
      straggler_lib.sleep(self.straggler.delay(
          self.straggler.worker, time.perf_counter() - t0))
    means = {k: float(v) for k, v in means.items()}
    task_means = {k: means.pop(k) for k in self.task.metric_names}
    return {f"train/{k}": v
            for k, v in {**self.task.report(task_means), **means}.items()}

  # -- Reporting: bytes on the wire --

  def report(self) -> Report:
    step = int(self.step.numpy())
    return Report(scalars=compression.wire.scalars(
        self.compressor.bytes_at(max(step - 1, 0)), self.float32_bytes))

  def summary(self) -> Dict[str, object]:
    step = int(self.step.numpy())
    total = self.compressor.bytes_total(step)
    per_step = total / step if step else self.compressor.bytes_at(0)
    return compression.wire.summary(per_step, total, self.float32_bytes)
