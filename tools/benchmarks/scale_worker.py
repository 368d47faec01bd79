r"""One process of the scale suite: builds trainers and times them when told.

    python -m tools.benchmarks.scale_worker --driver=HOST:PORT

Started by `scale_bench.py`, alone (one worker, or one process with two
logical devices) or as every task of a `tools.launch` cluster (TF_CONFIG
set: MultiWorkerMirroredStrategy across the tasks). It connects to the
driver and answers one JSON line per command, so that the driver can time
the process groups in interleaved rounds while the others wait idle:

* `{"cmd": "build", "name": N, "flat": {...}, "warmup": S}`: builds the
  trainer of those flag values (once) and trains S untimed steps (traces);
* `{"cmd": "train", "name": N, "steps": S}`: trains S steps; answers the
  seconds;
* `{"cmd": "parameters", "name": N}`: the trainable floats of its model;
* `{"cmd": "memory", "name": N}`: what a sync trainer holds per device,
  and the process's peak RSS (without a name: the RSS alone);
* `{"cmd": "allreduce", "floats": F, "bucket_mb": B, "reps": R}`: the median
  seconds of one all-reduce of F float32 values in buckets of B MB, alone,
  and the median CPU seconds this process spent on it (all its threads: on
  a worker pinned to one core, CPU the backward pass cannot have);
* `{"cmd": "exit"}`.

Every task of a cluster gets the same commands, since a step is a
collective; an error is answered as `{"error": ...}`.
"""

import json
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_string("driver", None, "HOST:PORT of the scale_bench driver.")
flags.DEFINE_integer("num_devices", 1, "Logical devices of this process.")
flags.DEFINE_integer("threads", 0, "Intra-op threads (0: TensorFlow's).")
CONNECT_TIMEOUT_S = 120.0


class Worker:
  """The trainers of this process, by name."""

  def __init__(self, num_devices: int, threads: int):
    # pylint: disable=g-import-not-at-top
    from dist_loop.runtime import cluster as cluster_lib
    from dist_loop.runtime import devices, strategy
    self.cluster = cluster_lib.current()
    if threads:  # Before the runtime starts (the strategy starts it).
      import tensorflow as tf
      tf.config.threading.set_intra_op_parallelism_threads(threads)
    if self.cluster.num_trainers > 1:
      strategy.multi_worker(collective_timeout_s=300.0, cluster=self.cluster)
    self.devices = devices.configure(num_devices, "cpu")
    self.trainers = {}

  def build(self, name, flat, warmup):
    # pylint: disable=g-import-not-at-top
    import dist_loop
    from dist_loop import configure
    from dist_loop.parallel.modes import build_trainer
    from tools.benchmarks import common
    if name not in self.trainers:
      config = configure.validate(
          dist_loop.make_config(workdir="/tmp/unused", **flat), self.cluster)
      trainer = build_trainer(config, self.devices, common.load_data(config),
                              self.cluster)
      trainer.train(warmup)
      self.trainers[name] = trainer
    return {"built": name}

  def parameters(self, name):
    """The trainable floats of a trainer's model: its gradient's size."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    model = self.trainers[name].model
    return {"parameters": int(sum(np.prod(v.shape)
                                  for v in model.trainable_variables))}

  def memory(self, name=None):
    """What a sync trainer holds per device (`sharding.accounting`), and
    this process's peak resident set size so far."""
    import resource  # pylint: disable=g-import-not-at-top
    out = {"peak_rss_mb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    if name is not None:
      out.update(self.trainers[name].memory())
    return out

  def train(self, name, steps):
    t0 = time.perf_counter()
    self.trainers[name].train(steps)
    return {"seconds": time.perf_counter() - t0}

  def allreduce(self, floats, bucket_mb, reps):
    """One all-reduce of `floats` values alone, as the sync step sends its
    gradients (a list of tensors, packed into buckets)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from dist_loop.runtime import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
    strategy = (strategy_lib.multi_worker(300.0)
                if self.cluster.num_trainers > 1
                else strategy_lib.mirrored(self.devices))
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=int(bucket_mb * 2**20))
    # Ten equal tensors, as a model's gradients are several.
    parts = [floats // 10] * 9 + [floats - 9 * (floats // 10)]

    @tf.function(autograph=False)
    def reduce_once():
      def replica():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce("sum", [tf.ones([n]) for n in parts],
                              options=options)
      return strategy.run(replica)

    reduce_once()
    times, cpu = [], []
    for _ in range(reps):
      t0, c0 = time.perf_counter(), time.process_time()
      tf.nest.map_structure(lambda t: t.numpy(), strategy.experimental_local_results(
          reduce_once()))
      times.append(time.perf_counter() - t0)
      cpu.append(time.process_time() - c0)
    return {"seconds": statistics.median(times),
            "cpu_seconds": statistics.median(cpu)}

  def close(self):
    for trainer in self.trainers.values():
      trainer.close()


def main(argv):
  del argv
  host, port = FLAGS.driver.rsplit(":", 1)
  worker = Worker(FLAGS.num_devices, FLAGS.threads)
  with socket.create_connection((host, int(port)),
                                timeout=CONNECT_TIMEOUT_S) as sock:
    sock.settimeout(None)  # A command may take long; the driver bounds it.
    stream = sock.makefile("rw")
    stream.write(json.dumps({"task": worker.cluster.task_name}) + "\n")
    stream.flush()
    for line in stream:
      message = json.loads(line)
      command = message.pop("cmd")
      if command == "exit":
        break
      try:
        reply = getattr(worker, command)(**message)
      except Exception as e:  # pylint: disable=broad-except
        reply = {"error": f"{type(e).__name__}: {e}"}
      stream.write(json.dumps(reply) + "\n")
      stream.flush()
  worker.close()
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  flags.mark_flag_as_required("driver")
  app.run(main)
