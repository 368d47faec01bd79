"""`--data_service=ADDRESS`: the input's parsing on tf.data service workers.

A trainer's input pipeline (`shard_stream.train_dataset_fn`) is sent to a
tf.data service dispatcher, whose workers run it and stream the batches
back. Sharding policy: `HINT` (static), with the shard point right after
the records are batched per replica: data worker w of W parses and
decodes per-replica batches w, w+W, ... of the trainer's stream. So:

* each per-replica batch of the stream is produced exactly once, with the
  same examples as without the service (no worker failure assumed: a
  static policy does not move a lost worker's share);
* the order in which the trainer receives them follows the workers'
  pace, so N devices = 1 device and an exact resume hold only with one
  data worker; a resume restarts the stream at the checkpoint's step.

The other policies: `OFF` has every worker produce the whole stream (each
batch W times); `DYNAMIC` hands out the source's elements first come,
first served (at most once, in no fixed order, and a worker's prefetched
share is lost on failure). Static sharding is the only one of the three
that keeps each epoch's examples exactly once with several workers.

Only TFRecord shards: the service ships the pipeline's graph to other
processes, and ArrayRecord reads run Python (`tf.numpy_function`), which
cannot travel. Each data worker reads the files front to back and parses
only its share.

`start_local` runs a dispatcher and W workers in this process (tests,
`tools.data_service`); on real hosts each runs as TensorFlow documents
(`tf.data.experimental.service.DispatchServer`, `WorkerServer`), the
dispatcher given the workers' addresses.
"""

import socket
import uuid
from typing import List, Tuple

import tensorflow as tf

_service = tf.data.experimental.service


def shard_point(ds: tf.data.Dataset) -> tf.data.Dataset:
  """Where a static policy cuts the stream among the data workers."""
  return ds.shard(tf.data.experimental.SHARD_HINT,
                  tf.data.experimental.SHARD_HINT)


def distribute(ds: tf.data.Dataset, address: str) -> tf.data.Dataset:
  """`ds` produced by the service at `address`, as a job of its own."""
  return ds.apply(_service.distribute(
      processing_mode=_service.ShardingPolicy.HINT, service=address,
      job_name=f"dist_loop-{uuid.uuid4().hex}"))


def free_ports(count: int) -> List[int]:
  sockets = [socket.socket() for _ in range(count)]
  try:
    for s in sockets:
      s.bind(("localhost", 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def start_local(num_workers: int, port: int = 0) -> Tuple[str, list]:
  """A dispatcher (on `port`, or a free one) and `num_workers` workers in
  this process.

  Returns:
    (the dispatcher's address for --data_service, the servers; keep them
    referenced while the service is used).
  """
  ports = free_ports(num_workers + 1)
  ports[0] = port or ports[0]
  workers = [f"localhost:{p}" for p in ports[1:]]
  dispatcher = _service.DispatchServer(_service.DispatcherConfig(
      port=ports[0], worker_addresses=workers))
  address = dispatcher.target.split("://")[-1]
  servers = [dispatcher] + [
      _service.WorkerServer(_service.WorkerConfig(
          dispatcher_address=address, worker_address=w, port=p))
      for w, p in zip(workers, ports[1:])]
  return dispatcher.target, servers
