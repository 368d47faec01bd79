"""The tasks of a --mode=ps cluster that do not train: workers and PSs.

Every task of the cluster runs the same train command. The chief trains
(it is the coordinator); a worker or parameter-server task only runs a
TensorFlow server, on which the chief places variables (PS) or runs
functions (worker). Such a task serves in `join_cluster`, the first thing
its process does, and its process ends there: it never trains, writes or
returns.
"""

import os
import time
from typing import NoReturn

import tensorflow as tf
from absl import logging

from dist_loop.runtime import cluster as cluster_lib
from dist_loop.runtime.cluster import Cluster

# The exit code of a server stopped by Ctrl-C (128 + SIGINT, as shells say).
EXIT_INTERRUPTED = 130
# Python sees a Ctrl-C when the main thread wakes up (the signal may land on
# one of the server's threads): the longest it takes to stop.
_WAKE_S = 1.0


def join_cluster(config, cluster: Cluster) -> None:
  """Runs first in every process of the cluster; returns only on the chief.

  Args:
    config: the run's `Config`.
    cluster: this process's place in the cluster.

  Raises:
    SystemExit: on a worker or PS, when it is stopped (see `serve`).
  """
  # TensorFlow's advice for PS training: a failed RPC fails the call at once
  # instead of waiting for the peer, so the chief notices a lost task.
  os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
  if cluster.task_type in (cluster_lib.WORKER, cluster_lib.PS):
    serve(config, cluster)


def serve(config, cluster: Cluster) -> NoReturn:
  """Runs this task's server until the process is stopped.

  How the process ends: SIGTERM (how `tools.launch` stops the servers once
  the chief is done) or SIGKILL end it at once; Ctrl-C (SIGINT) exits with
  `EXIT_INTERRUPTED`, through `SystemExit`. The server's own `join()` is
  not used: it blocks in C++, where Python never sees a Ctrl-C.

  Raises:
    SystemExit: on Ctrl-C.
  """
  # A server runs one op per concurrent remote call; with fewer inter-op
  # threads than workers + 1 the cluster can deadlock.
  threads = max(config.inter_op_threads, cluster.num_workers + 1)
  server = tf.distribute.Server(
      tf.train.ClusterSpec(cluster.as_dict()), job_name=cluster.task_type,
      task_index=cluster.task_index, protocol="grpc",
      config=tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads),
      start=True)
  logging.info("serving %s at %s until stopped", cluster.task_name,
               server.target)
  try:
    while True:  # The server runs on its own threads.
      time.sleep(_WAKE_S)
  except KeyboardInterrupt:
    logging.info("%s: interrupted; the server stops", cluster.task_name)
  raise SystemExit(EXIT_INTERRUPTED)
