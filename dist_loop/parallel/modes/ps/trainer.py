"""--mode=ps: parameter-server training, the chief's side.

The cluster has a chief, W workers and P parameter servers; the workers
and PSs only serve (`server.py`). Every variable lives on the PSs. The
chief is the coordinator (ParameterServerStrategy + ClusterCoordinator) and
the only process that runs `train`:

    chief: train(n)    target = step + n
      schedule ceil(remaining / K) calls of `_loop` on the workers,
      wait for them, read the stats, repeat until step == target
                                          (K = --ps_steps_per_call)
    a worker, one step of `_loop`:
      v = step                            the version, read first
      g = gradients of its batch on the weights read from the PSs
      the locked update (update.py): apply g, or drop it if tau > bound

The version is `step`, the number of applied updates, as in --mode=async:
a dropped gradient does not advance it, so the next gradient read after an
applied update is fresh, and the run progresses for any bound and any W.

The chief never copies a result from a worker: a scheduled call returns
nothing, and the chief reads `step` and the stats vector (stats.py) from
the PSs between rounds, while no call runs, so a round's only remote
traffic is the calls themselves.

Data: each worker has its own dataset (`create_per_worker_dataset`). Its
function is traced once and runs on every worker, so it draws its shard id
from a PS counter (counter.py): the workers read disjoint slices of the
same global stream as the other modes.

Faults: the coordinator re-runs a lost worker's calls on the others, so a
killed worker only slows training (and may leave its one update in the
lock part-done, see update.py). A lost PS loses variables: the run stops
with `ClusterError`, and rerunning the command on a restarted cluster
resumes from the last checkpoint. Every wait is bounded by
--collective_timeout_s.
"""

import math
import time
from typing import Dict

import numpy as np
import tensorflow as tf

from dist_loop import models
from dist_loop.core.errors import NonFiniteError, UserError
from dist_loop.data import train_dataset_fn
from dist_loop.parallel.modes.base import MODES, Report, Reporting, Trainer
from dist_loop.parallel.modes.ps import counter, server
from dist_loop.parallel.modes.ps import stats as stats_lib
from dist_loop.parallel.modes.ps import update as update_lib
from dist_loop.parallel.modes.ps.options import PSOptions
from dist_loop.runtime import cluster as cluster_lib
from dist_loop.runtime import strategy as strategy_lib
from dist_loop.runtime.cluster import ClusterError
from dist_loop.training import optim
from dist_loop.training import precision as precision_lib
from dist_loop.training import step as step_lib

_POLL_S = 0.1


@MODES.register("ps")
class PSTrainer(Trainer, Reporting):
  """The coordinator: schedules K-step calls on the workers."""

  Options = PSOptions
  multi_process = True
  precisions = precision_lib.PRECISIONS  # float16: see update.py.
  checks_max_loss = True
  xla_state_refusal = (
      "--mode=ps --jit_compile runs the model on weights read from the PSs, "
      "and the model has non-trainable state ({variable}, ...) that would "
      "not follow; drop --jit_compile, or use --mode=async or sync")

  # -- before TensorFlow starts --

  @classmethod
  def async_checkpoint_refusal(cls, config):
    del config
    return ("--mode=ps keeps its variables on the parameter servers, which "
            "the background save does not copy")

  @classmethod
  def num_replicas(cls, config, cluster) -> int:
    return 1  # A step is one worker's batch of --global_batch_size examples.

  @classmethod
  def input_pipelines(cls, config, cluster) -> int:
    del config
    return cluster.num_workers  # The chief reads none (`_dataset_fn`).

  @classmethod
  def validate(cls, config, cluster) -> None:
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
    super().validate(config, cluster)

  @classmethod
  def join_cluster(cls, config, cluster) -> None:
    server.join_cluster(config, cluster)  # Workers and PSs end there.

  @classmethod
  def cluster_error(cls, config, cluster, error):
    """A lost PS (or every worker) anywhere in the run: building the
    variables, a step, a checkpoint, an evaluation, a read of `step`."""
    del cluster
    if not isinstance(error, strategy_lib.LOST_TASK_ERRORS):
      return None
    return ClusterError(
        f"a parameter server is unreachable ({cluster_lib.describe(error)}); "
        "its variables are lost. Restart the cluster and rerun the same "
        f"command: training resumes from the last checkpoint in "
        f"{config.workdir}")

  # -- the variables, on the PSs --

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    self.num_workers = cluster.num_workers
    # TensorFlow's connection to the servers waits forever for a task that
    # never starts; this wait is bounded by --join_timeout_s.
    strategy_lib.wait_for_servers(cluster, config.join_timeout_s)
    self.strategy = tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster.as_dict()),
            task_type=cluster.task_type, task_id=cluster.task_index,
            rpc_layer="grpc"))
    self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
        self.strategy)
    self.layout = stats_lib.Layout(self.task.metric_names
                                   + self.recipe.mean_keys)
    with self.strategy.scope():
      self.model = models.build_for(config, dataset)
      self.refuse_xla(self.model)
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables,
                                  config.weight_decay)
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False,
                              name="step")
      self._shards = tf.Variable(0, dtype=tf.int64, trainable=False,
                                 name="input_shards")
      # The budget reaches the workers through a PS variable, set while no
      # call runs: a scheduled call's only argument is its iterator.
      self._target = tf.Variable(0, dtype=tf.int64, trainable=False,
                                 name="step_budget")
      self._stats = tf.Variable(tf.zeros([self.layout.size], tf.float64),
                                trainable=False, name="round_stats")
    self._update = update_lib.LockedUpdate(
        optimizer=self.optimizer, variables=self.model.trainable_variables,
        step=self.step, stats=self._stats, layout=self.layout,
        max_staleness=self.options.max_staleness, loss_scale=self.loss_scale,
        max_loss=config.max_loss, rate=self.recipe.rate)
    self._loop = tf.function(self._loop_fn, autograph=False)
    self._iterator = None
    self._start_step = 0  # Where the workers' input starts (set at resume).
    self._applied_start = None  # `step` when this process first trained.
    self.totals = stats_lib.Totals()

  def scope(self):
    return self.strategy.scope()

  def close(self) -> None:
    # Released now, not at interpreter exit. The iterators run on the
    # workers with autotuning off (`data/stream.py`), so freeing one there
    # only stops its tf.data threads.
    self._iterator = None

  # -- on a worker: up to K steps per scheduled call --

  def _dataset_fn(self):
    """Worker k of W reads input pipeline k of the global stream."""
    shard = counter.fetch_add(self._shards) % self.num_workers
    context = tf.distribute.InputContext(
        num_input_pipelines=self.num_workers, input_pipeline_id=shard,
        num_replicas_in_sync=self.num_workers)
    fn = train_dataset_fn(
        self.dataset.train_x, self.dataset.train_y,
        self.config.global_batch_size * self.num_workers, self.config.seed,
        start_step=self._start_step // self.num_workers)
    return fn(context)

  def _worker_step(self, x, y):
    """One batch: its metrics and unscaled gradients, the version `v` the
    weights were read at, and the loss scale they were computed at."""
    # Read v after the batch arrived (loop-variant, so the read is never
    # hoisted out of the step loop) and before the weights.
    with tf.control_dependencies([x, y]):
      read_version = self.step.read_value()
    with tf.control_dependencies([read_version]):
      scale = (None if self.loss_scale is None
               else self.loss_scale.scale.read_value())
      # Under XLA the weights are read first: a computation runs on one
      # device, and the variables live on the PSs.
      weights = ([tf.convert_to_tensor(v)
                  for v in self.model.trainable_variables]
                 if self.config.jit_compile else None)
      metrics, grads = step_lib.accumulated_gradients(
          self.task, self.model, x, y, chunks=1,
          examples_per_update=self.config.global_batch_size, scale=scale,
          weights=weights, jit_compile=self.config.jit_compile)
    if scale is not None:
      grads = [g / scale for g in grads]
    metrics["grad_norm"] = tf.linalg.global_norm(grads)
    # Clipping is per push, on the worker, where its gradient's norm is.
    grads, clipped = self.recipe.clip(grads, metrics["grad_norm"])
    metrics.update(clipped)
    return {"grads": grads, "read_version": read_version, "metrics": metrics,
            "computed_at": tf.constant(1.0) if scale is None else scale}

  def _loop_fn(self, iterator):
    """Up to K steps on this worker. Returns nothing: the outcome is in
    `step` and the stats vector, on the PSs."""
    target = self._target.read_value()

    def more(i):  # Read before each step: other workers move it too.
      return tf.logical_and(i < self.options.ps_steps_per_call,
                            self.step.read_value() < target)

    def step(i):
      x, y = next(iterator)
      out = self.strategy.run(self._worker_step, args=(x, y))
      out = tf.nest.map_structure(
          lambda v: self.strategy.experimental_local_results(v)[0], out)
      self._update(out["grads"], out["read_version"], target, out["metrics"],
                   out["computed_at"])
      return i + 1

    tf.while_loop(more, step, [tf.constant(0)])

  # -- on the chief --

  def train(self, num_steps: int) -> Dict[str, float]:
    start = int(self.step.numpy())
    if self._applied_start is None:
      self._applied_start = start
    if self._iterator is None:  # Built lazily: resumes at the restored step.
      self._start_step = start
      self._iterator = iter(
          self.coordinator.create_per_worker_dataset(
              tf.autograph.experimental.do_not_convert(self._dataset_fn)))
    target = start + num_steps
    self._target.assign(target)
    self._stats.assign(tf.zeros_like(self._stats))
    step, record = start, self.layout.read(np.zeros(self.layout.size))
    while step < target:
      calls = math.ceil((target - step) / self.options.ps_steps_per_call)
      try:
        for _ in range(calls):
          self.coordinator.schedule(self._loop, args=(self._iterator,))
        self._wait(step)
      except KeyboardInterrupt:
        # Let the scheduled calls finish first, so the checkpoint the
        # controller saves next is of still variables at the step it names.
        self._wait(step)
        raise
      record = self.layout.read(self._stats.numpy())
      if record.counts["nonfinite"]:
        raise NonFiniteError(int(self.step.numpy()) + 1)
      step = int(self.step.numpy())
    self.totals.add(record)
    return stats_lib.call_metrics(self.task, record, self.loss_scale)

  def _wait(self, step: int) -> None:
    wait_for_round(self.coordinator, self.config.collective_timeout_s, step,
                   self.num_workers)

  def _applied(self) -> int:
    """Updates applied since this process first trained (exact)."""
    if self._applied_start is None:
      return 0
    return int(self.step.numpy()) - self._applied_start

  # -- reporting --

  def report(self) -> Report:
    window = self.totals.take_window()
    return Report(
        scalars={"ps/applied": float(self._applied()),
                 **self.totals.scalars(), **window.scalars("ps")},
        histograms=({"ps/staleness": window.samples()} if window.total
                    else {}))

  def summary(self) -> Dict[str, object]:
    return {
        "ps_workers": self.num_workers,
        # The strategy places whole variables round-robin over the servers.
        "ps_servers_holding_weights": len(
            {v.value.device for v in self.model.trainable_variables}),
        "ps_applied": self._applied(),
        "ps_max_staleness": self.options.max_staleness,
        **self.totals.summary(),
        # For comparison: `step` is the exact count (see update.py).
        "ps_optimizer_iterations": int(np.asarray(self.optimizer.iterations)),
    }


def wait_for_round(coordinator, timeout_s: float, step: int,
                   num_workers: int) -> None:
  """`coordinator.join()`, bounded by `timeout_s` per round.

  Polls `coordinator.done()`, which runs no TensorFlow op: the main thread
  stays out of the eager runtime while the coordinator's threads use it. A
  lost worker's calls are re-run on the others, so a round only stalls if
  every worker is lost; a lost PS makes `done()` raise.

  Raises:
    ClusterError: the round did not finish within `timeout_s`.
  """
  deadline = time.monotonic() + timeout_s
  while not coordinator.done():
    if time.monotonic() > deadline:
      raise ClusterError(
          f"a round of scheduled calls from step {step} did not finish "
          f"within --collective_timeout_s={timeout_s:g}: are all "
          f"{num_workers} workers down? Restart them and rerun the command "
          "to resume from the last checkpoint")
    time.sleep(_POLL_S)
  coordinator.join()  # Returns at once; raises a call's error.
