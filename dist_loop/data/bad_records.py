"""`--skip_bad_records`: train past records that fail to parse, counted.

Without it, a record that does not parse stops the run naming its file
and index (`shard_stream.Split.parse`). With it, each record is parsed on
its own; one whose parse fails (not a `tf.train.Example`, or bytes that do
not match the spec) is dropped and counted. Past `--max_bad_records` the
input stops with one line, so a run never trains on mostly garbage. The
trainer's process reports the count as `data/bad_records`, summary.json
as `bad_records`.

**The count is the run's**: every input pipeline of the run adds to one
`Ledger` (async's worker threads, ps's workers), which is a checkpoint
item (`bad_records`), so a resumed run goes on from its count and the
limit applies to the run's total. A resumed input reads some bad records
again: those its prefetch had read past the checkpoint's step, and, since
a skip completes a batch from the records after it, those among as many
records before the step as had been skipped. So the ledger keeps the
*places* of the last `RECENT` bad records it counted, numbered in the order
counted: a record at a place it holds is not counted again and keeps its
number, so the limit stops a resumed run at the same record. A place is
where a record sits in the stream of steps: step t's E examples (over all
replicas and processes) are places [t*E, (t+1)*E), pipeline p's share of
them [t*E + p*K, t*E + (p+1)*K) for its K records a step, in the order it
reads them; the same record read again after a resume is at the same
place, in both formats (`shard_stream._places`). The count is exact unless
more than `RECENT` bad records lie past a checkpoint's step when it is
saved, or the batch size (or async's and ps's number of workers) changes
at a resume, which moves the places.

The ledger's variables are made on the host of the process that trains,
once the trainer's strategy is built (`data.checkpoint_items`): under
--mode=ps the workers' inputs reach them there. Its count includes the
records the prefetch has read ahead of the step. A multi-worker sync or
local_sgd run, whose processes each read their own input, refuses
--skip_bad_records (`modes/mirrored.py`): its checkpoint holds the
chief's variables only.

A replica's batch is completed from the records after a skipped one, so
with skipping the per-replica cut is no longer exact, and a resume trains
again on the records that skips had moved before the checkpoint's step;
each record is still read at most once per epoch, by its own process.
"""

import tensorflow as tf

from dist_loop.data import stream

LIMIT_ERROR = "records failed to parse, more than --max_bad_records"
# The places of the bad records a ledger remembers (8 bytes each).
RECENT = 4096


class Ledger(tf.Module):
  """The bad records a run has counted: its checkpoint item.

  Attributes:
    count: int64, the bad records counted.
    places: int64 [RECENT], the places of the most recent of them: the
      record numbered n (from 1) at index (n - 1) mod RECENT; -1 where
      none is yet.
  """

  def __init__(self):
    super().__init__(name="bad_records")
    with tf.init_scope(), tf.device("/CPU:0"):
      self.count = tf.Variable(0, dtype=tf.int64, trainable=False,
                               name="count")
      self.places = tf.Variable(tf.fill([RECENT], tf.constant(-1, tf.int64)),
                                trainable=False, name="places")

  def add(self, places: tf.Tensor) -> tf.Tensor:
    """Counts the bad records at `places` (int64 [n], n > 0) that it has not
    counted. Returns the highest number among them, each record numbered
    in the order counted from 1: a record read again keeps its number, so
    the limit stops a resumed run at the same record."""
    matches = tf.equal(places[:, None], self.places[None, :])
    seen = tf.reduce_any(matches, axis=1)
    new = tf.boolean_mask(places, tf.logical_not(seen))
    added = tf.size(new, out_type=tf.int64)
    count = self.count.assign_add(added)
    before = count - added
    slots = (before + tf.range(added)) % RECENT
    # The record at slot i is the latest of numbers i+1, i+1+RECENT, ...
    # counted before these.
    slot = tf.boolean_mask(tf.argmax(tf.cast(matches, tf.int32), axis=1,
                                     output_type=tf.int64), seen)
    numbers = before - (before - 1 - slot) % RECENT
    none = tf.constant(0, tf.int64)
    highest = tf.maximum(tf.reduce_max(tf.concat([numbers, [none]], 0)),
                         tf.where(added > 0, count, none))
    with tf.control_dependencies([
        self.places.scatter_nd_update(slots[:, None], new)]):
      return tf.identity(highest)


class Skipper:
  """Drops and counts unparsable records of one input.

  Args:
    limit: the most bad records a run tolerates.
    where: the shards directory, named when the limit is passed.
  """

  def __init__(self, limit: int, where: str):
    self.limit, self.where = limit, where
    self._ledger = None

  @property
  def ledger(self) -> Ledger:
    """The run's count, made on first use (`data.checkpoint_items` makes it
    once the trainer's strategy is built)."""
    if self._ledger is None:
      self._ledger = Ledger()
    return self._ledger

  def batches(self, records: tf.data.Dataset, parse,
              batch_size: int) -> tf.data.Dataset:
    """Batches of (x, y), the last partial one kept, from a stream of
    (serialized, file, index) records; `parse` takes them batched, as
    `Split.parse`. Bad records are dropped, not counted (the eval split,
    a probe batch)."""
    return (self._good(records, parse)
            .map(stream.no_autograph(lambda _, x, y: (x, y)))
            .batch(batch_size))

  def train_batches(self, records: tf.data.Dataset, parse, batch_size: int,
                    place) -> tf.data.Dataset:
    """Full training batches of (x, y) from a pipeline's records, its bad
    ones counted in the ledger.

    Args:
      records: the pipeline's (serialized, file, index) records.
      parse: as in `batches`.
      batch_size: examples of a batch.
      place: fn(i) -> the places of the pipeline's records i (int64
        tensors; i counts from the first record it reads).
    """
    ledger = self.ledger

    @stream.no_autograph
    def gap(expected, element):  # The bad records before this good one.
      position, x, y = element
      return position + 1, (x, y, expected, position)

    # Counted a batch at a time: the ledger's variables may be in another
    # process (the chief, under ps), and a function that reaches them
    # costs a call there each time it runs.
    @stream.no_autograph
    def counted(x, y, firsts, ends):
      bad = tf.ragged.range(firsts, ends).flat_values
      highest = tf.cond(tf.size(bad) > 0, lambda: ledger.add(place(bad)),
                        lambda: tf.constant(0, tf.int64))
      check = tf.debugging.Assert(highest <= self.limit, [
          highest, f"{LIMIT_ERROR}={self.limit} in {self.where}"])
      with tf.control_dependencies([check]):
        return tf.identity(x), y

    return (self._good(records, parse)
            .scan(tf.constant(0, tf.int64), gap)
            .batch(batch_size, drop_remainder=True)
            .map(counted))

  @staticmethod
  def _good(records: tf.data.Dataset, parse) -> tf.data.Dataset:
    """(position, x, y) of the records that parse, in order."""
    @stream.no_autograph
    def parse_one(position, record):
      x, y = parse(*(tf.expand_dims(t, 0) for t in record))
      return position, x[0], y[0]

    return (records.enumerate()
            .map(parse_one, num_parallel_calls=stream.parallel_calls(),
                 deterministic=True)
            .ignore_errors())

  def metrics(self):
    return {"data/bad_records": float(self.ledger.count.numpy())}
