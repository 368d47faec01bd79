"""The rules of a mode whose replicas mirror the variables, in one process
(MirroredStrategy) or across the workers of a cluster
(MultiWorkerMirroredStrategy): sync and local_sgd.

`Mirrored` is a mixin of class methods and three instance methods; a mode
lists it before its base class. It decides:

* how many replicas there are: every training process's `--num_devices`;
* which clusters it accepts: workers only, one replica per worker on CPU,
  and no --skip_bad_records over several workers (each would count its
  own input's bad records, and the checkpoint keep the chief's count);
* when the multi-worker strategy is built: in `join_cluster`, before any
  op runs, as TensorFlow requires (the thread pools are set just before it,
  since building it starts the runtime);
* what a lost peer means: one line naming `--collective_timeout_s`;
* the strategy itself (`build_strategy`), checked against the replica
  count the config asked for;
* where the master variables are read (`scope`) and differentiated
  (`on_master`: on the first replica).
"""

import tensorflow as tf

from dist_loop.core.config import check_divisible
from dist_loop.core.errors import UserError
from dist_loop.runtime import cluster as cluster_lib
from dist_loop.runtime import devices as devices_lib
from dist_loop.runtime import strategy as strategy_lib


class Mirrored:
  """What the modes that run (MultiWorker)Mirrored strategies share. See
  the module docstring."""

  multi_process = True

  @classmethod
  def num_replicas(cls, config, cluster) -> int:
    # Multi-worker: every training process contributes its devices.
    return config.num_devices * max(cluster.num_trainers, 1)

  @classmethod
  def validate(cls, config, cluster) -> None:
    """The cluster rules, then the batch split. Raises UserError."""
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
    if cluster.num_trainers > 1 and getattr(config.dataset_options,
                                            "skip_bad_records", False):
      raise UserError(
          f"--skip_bad_records counts a run's bad records in one place, but "
          f"each of the {cluster.num_trainers} workers of this "
          f"--mode={config.mode} run reads its own input and the "
          "checkpoint keeps the chief's count only; train in one process "
          "(or --mode=ps), or drop --skip_bad_records")
    check_divisible(config.global_batch_size,
                    cls.num_replicas(config, cluster))

  @classmethod
  def join_cluster(cls, config, cluster) -> None:
    if cluster.num_trainers > 1:
      devices_lib.set_threads(config.intra_op_threads,
                              config.inter_op_threads)
      strategy_lib.multi_worker(config.collective_timeout_s, cluster,
                                config.join_timeout_s)

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

  def build_strategy(self) -> tf.distribute.Strategy:
    """The run's strategy: the process's MultiWorkerMirroredStrategy (built
    by `join_cluster`) when several processes train, else a
    MirroredStrategy over the run's devices; one device still goes through
    it, so the 1-device run exercises the same code as the N-device one.

    Raises:
      UserError: the strategy's replicas are not what the config asked for.
    """
    config, cluster = self.config, self.cluster
    if cluster.num_trainers > 1:
      strategy = strategy_lib.multi_worker(config.collective_timeout_s)
    else:
      strategy = strategy_lib.mirrored(self.devices)
    replicas = strategy.num_replicas_in_sync
    wanted = self.num_replicas(config, cluster)
    if replicas != wanted:
      raise UserError(
          f"the strategy has {replicas} replicas but --num_devices="
          f"{config.num_devices} on each of {cluster.num_trainers} workers "
          f"asks for {wanted}; make every worker see --num_devices devices")
    return strategy

  def scope(self):
    return self.strategy.scope()

  def on_master(self, fn, *args):
    cache = self.__dict__.setdefault("_on_master_fns", {})
    return strategy_lib.on_first_replica(self.strategy, cache, fn, *args)
