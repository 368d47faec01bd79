"""Preemption: SIGTERM stops the run at the end of an inner loop, on every
worker of a multi-worker run at the same step, within a grace period.

SIGTERM (a preempted machine, a scheduler) reaches one process. `Sigterm`
turns it into a request the controller reads after every inner loop (the
controller then has a checkpoint of that step saved and raises
`Interrupted`), and starts a watchdog that ends the process with exit code
143 if it is still alive `grace_period_s` after the signal: a loop that
hangs must not outlive the preemption notice.

When the workers train in lockstep (MultiWorkerMirroredStrategy), a
checkpoint is a collective every worker joins at the same step: the
signalled worker cannot save alone, and a worker that went on would be a
step ahead. So at every loop boundary each worker adds its own flag ("asked
to stop") to an all-reduce through the run's strategy (`Agreement`). Every
worker sees the same sum; if it is not 0, all of them save the same step and
exit.

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

import math
import os
import signal
import threading
from typing import Callable, ContextManager, Optional

import tensorflow as tf
from absl import logging

from dist_loop.core.errors import Interrupted

SIGTERM_EXIT_CODE = Interrupted.EXIT_CODES["SIGTERM"]


class Sigterm:
  """SIGTERM as a stop request, for the duration of a `with` block.

  Args:
    grace_period_s: after the signal, the process ends with exit code 143
      once this many seconds have passed, whatever it is doing. A period no
      timer can wait for (inf, or beyond `threading.TIMEOUT_MAX`, about 292
      years) sets no watchdog: the run stops when its loop ends.
    agreement: a multi-worker run's `Agreement`, or None.
    exit_fn: ends the process (tests replace it).
  """

  def __init__(self, grace_period_s: float,
               agreement: Optional["Agreement"] = None,
               exit_fn: Callable[[int], None] = os._exit):
    self.grace_period_s = grace_period_s
    self.agreement = agreement
    self._exit = exit_fn
    self.signalled = False
    self.watchdog: Optional[threading.Timer] = None
    self._saved = False
    self._previous = None

  def __enter__(self) -> "Sigterm":
    # Only the main thread may install a handler; elsewhere (a library
    # user's thread) the run simply does not react to SIGTERM.
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_signal)
    return self

  def __exit__(self, *exc_info) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
    # The watchdog is left running: it bounds the teardown that follows.

  def requested(self) -> bool:
    """Whether this process, or any worker of a multi-worker run, got
    SIGTERM. With an agreement it is a collective: every worker calls it
    after every loop, so all agree on the step."""
    if self.agreement is None:
      return self.signalled
    stop = self.agreement.any(self.signalled)
    if stop and not self.signalled:
      logging.warning("Another worker got SIGTERM: saving a checkpoint with "
                      "every worker, then exiting.")
    return stop

  def saved(self) -> None:
    """The checkpoint of the stop step is saved (for the watchdog's line)."""
    self._saved = True

  def _on_signal(self, signum, frame) -> None:
    del signum, frame
    if self.signalled:
      return
    self.signalled = True
    seconds = watchdog_seconds(self.grace_period_s)
    if seconds is None:
      logging.warning("SIGTERM: saving a checkpoint at the end of this loop, "
                      "then exiting (--grace_period_s=%g: no time limit).",
                      self.grace_period_s)
      return
    logging.warning("SIGTERM: saving a checkpoint and exiting within %gs.",
                    seconds)
    self.watchdog = threading.Timer(seconds, self._grace_over)
    self.watchdog.daemon = True
    self.watchdog.start()

  def _grace_over(self) -> None:
    if self._saved:
      logging.error("Still running --grace_period_s=%g after SIGTERM; "
                    "exiting. The checkpoint was saved.", self.grace_period_s)
    else:
      logging.error("No checkpoint within --grace_period_s=%g after SIGTERM;"
                    " exiting. The last saved checkpoint is intact.",
                    self.grace_period_s)
    self._exit(SIGTERM_EXIT_CODE)


def watchdog_seconds(grace_period_s: float) -> Optional[float]:
  """The seconds a watchdog waits, or None for a period no timer can wait
  (`threading.Timer` raises OverflowError in its thread beyond
  `threading.TIMEOUT_MAX`)."""
  if (not math.isfinite(grace_period_s)
      or grace_period_s > threading.TIMEOUT_MAX):
    return None
  return max(grace_period_s, 0.0)


class Agreement:
  """Whether any worker of the run was asked to stop, agreed by all.

  Args:
    strategy: the run's strategy, whose replicas span every worker.
  """

  def __init__(self, strategy: tf.distribute.Strategy):
    self.strategy = strategy
    self._count = tf.function(self._count_fn, autograph=False)

  @classmethod
  def for_run(cls, scope: Optional[Callable[[], ContextManager]],
              cluster) -> Optional["Agreement"]:
    """The agreement of a run whose workers all run the training loop (a
    cluster of several workers and no parameter servers), or None: a run
    of one process, or a ps run, whose chief alone trains and saves.

    Args:
      scope: returns the context (a strategy's scope) in which the run's
        strategy is current, such as a trainer's `scope`.
      cluster: the run's `Cluster`.
    """
    if cluster.num_ps or cluster.num_trainers <= 1:
      return None
    with scope():
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
