"""`--skip_bad_records`: train past records that fail to parse, counted.

Without it, a record that does not parse stops the run naming its file
and index (`shard_stream.Split.parse`). With it, each record is parsed on
its own; one whose parse fails (not a `tf.train.Example`, or bytes that do
not match the spec) is dropped, and the gap it leaves in the record
numbering is added to a host counter. Past `--max_bad_records` the input
stops with one line, so a run never trains on mostly garbage. The count
is this process's since it started (a resumed run counts afresh); the
trainer reports it as `data/bad_records` and summary.json as
`bad_records`.

A replica's batch is completed from the records after a skipped one, so
with skipping the per-replica cut is no longer exact; each record is still
read at most once per epoch, by its own process.
"""

import tensorflow as tf

from dist_loop.data import stream

LIMIT_ERROR = "records failed to parse, more than --max_bad_records"


class Skipper:
  """Drops and counts unparsable records of one input.

  Args:
    limit: the most bad records a run tolerates.
    where: the shards directory, named when the limit is passed.
  """

  def __init__(self, limit: int, where: str):
    self.limit, self.where = limit, where
    with tf.device("/CPU:0"):
      self.count = tf.Variable(0, dtype=tf.int64, trainable=False)

  def batches(self, records: tf.data.Dataset, parse, batch_size: int,
              count: bool = True) -> tf.data.Dataset:
    """Batches of (x, y) from a stream of (serialized, file, index)
    records; `parse` takes them batched, as `Split.parse`. Training
    batches are full and the bad records `count`ed; others (`count=False`:
    the first examples of a probe) keep a last partial batch."""
    @stream.no_autograph
    def parse_one(position, record):
      x, y = parse(*(tf.expand_dims(t, 0) for t in record))
      return position, x[0], y[0]

    @stream.no_autograph
    def counted(expected, element):
      position, x, y = element
      total = self.count.assign_add(position - expected)
      check = tf.debugging.Assert(total <= self.limit, [
          total, f"{LIMIT_ERROR}={self.limit} in {self.where}"])
      with tf.control_dependencies([check]):
        return position + 1, (tf.identity(x), y)

    good = (records.enumerate()
            .map(parse_one, num_parallel_calls=stream.parallel_calls(),
                 deterministic=True)
            .ignore_errors())
    if not count:
      return good.map(stream.no_autograph(lambda _, x, y: (x, y))).batch(
          batch_size)
    return (good.scan(tf.constant(0, tf.int64), counted)
            .batch(batch_size, drop_remainder=True))

  def metrics(self):
    return {"data/bad_records": float(self.count.numpy())}
