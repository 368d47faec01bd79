"""Coordinated preemption: every worker of a multi-worker run stops at the
same step.

SIGTERM (a preempted machine, a scheduler) reaches one process. When the
workers train in lockstep (MultiWorkerMirroredStrategy), a checkpoint is a
collective every worker joins at the same step: the signalled worker cannot
save alone, and a worker that went on would be a step ahead. So at every loop
boundary each worker adds its own flag ("asked to stop") to an all-reduce
through the run's strategy. Every worker sees the same sum; if it is not 0,
all of them save the same step and exit (the controller does that).

Why not `tf.distribute.experimental.PreemptionCheckpointHandler`: it does
work with Keras 3 objects on TF 2.21 (two workers saved the same step when
one got SIGTERM), but it takes over what the run owns. Built, it restores
the newest checkpoint itself, with no fallback to an older readable one; it
adds its own counter variable to the checkpoint; it replaces the SIGTERM
handler and ends the process through its `exit_fn`; and given a
`tf.train.Checkpoint` it keeps managers of its own (max_to_keep=1) in the
chief's directory. One all-reduce of a number per loop is the same agreement
without any of that.
"""

from typing import Optional

import tensorflow as tf


class Agreement:
  """Whether any worker of the run was asked to stop, agreed by all.

  Args:
    strategy: the run's strategy, whose replicas span every worker.
  """

  def __init__(self, strategy: tf.distribute.Strategy):
    self.strategy = strategy
    self._count = tf.function(self._count_fn)

  @classmethod
  def for_run(cls, trainer, cluster) -> Optional["Agreement"]:
    """The agreement of a run whose workers all run the training loop (a
    cluster of several workers and no parameter servers), or None: a run
    of one process, or a ps run, whose chief alone trains and saves."""
    if cluster.num_ps or cluster.num_trainers <= 1:
      return None
    with trainer.scope():
      return cls(tf.distribute.get_strategy())

  def any(self, local: bool) -> bool:
    """Whether `local` is True on any worker. A collective: every worker
    must call it at the same point of the run."""
    return float(self._count(tf.constant(float(local)))) > 0

  def _count_fn(self, flag):
    def replica(f):
      # The identity puts the flag on the replica's device (an input of the
      # function has none, and a collective needs one).
      return tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.SUM, tf.identity(f))

    out = self.strategy.run(replica, args=(flag,))
    return self.strategy.experimental_local_results(out)[0]
