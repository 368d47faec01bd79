"""`--straggler=WORKER:FACTOR`: one worker made FACTOR times slower.

A research and benchmarking knob: the slowed worker sleeps (FACTOR - 1) times
its own measured compute time after each step, so its step takes FACTOR times
as long wherever that compute time comes from (model, batch, contention). The
sync mode slows its whole step the same way, because a synchronous step waits
for its slowest replica; the async mode slows only that worker. Both modes
parse and check the flag with the functions here, at flag-parse time.
FACTOR is at most `MAX_FACTOR`: the sleep must stay within what `time.sleep`
accepts (a factor of 1e300 overflowed it), and a hundredfold slow-down is
past what a straggler study needs.
"""

import dataclasses
import threading
import time
from typing import Optional

from dist_loop.core.errors import UserError
from dist_loop.core.options import option

MAX_FACTOR = 100.0


@dataclasses.dataclass(frozen=True)
class Straggler:
  """Worker (or replica) `worker` runs `factor` times slower."""

  worker: int
  factor: float

  def delay(self, worker: int, compute_seconds: float) -> float:
    """Seconds to sleep after `worker` computed for `compute_seconds`."""
    if worker != self.worker:
      return 0.0
    return (self.factor - 1.0) * max(compute_seconds, 0.0)


def parse(spec: Optional[str]) -> Optional[Straggler]:
  """`"WORKER:FACTOR"` -> Straggler; None or "" -> None.

  Raises:
    UserError: the text is not WORKER:FACTOR with WORKER >= 0 and
      1 <= FACTOR <= MAX_FACTOR.
  """
  if not spec:
    return None
  usage = (f"--straggler={spec!r} must be WORKER:FACTOR, a worker index and a "
           f"slow-down factor from 1 to {MAX_FACTOR:g}, e.g. --straggler=1:3")
  worker, sep, factor = spec.partition(":")
  if not sep:
    raise UserError(usage)
  try:
    worker_i, factor_f = int(worker), float(factor)
  except ValueError:
    raise UserError(usage) from None
  if worker_i < 0 or not 1.0 <= factor_f <= MAX_FACTOR:
    raise UserError(usage)
  return Straggler(worker_i, factor_f)


def check(spec: Optional[str], num_workers: int, what: str) -> None:
  """Parses `spec` and checks its worker index against `num_workers`.

  Args:
    spec: the --straggler value.
    num_workers: how many workers (async) or replicas (sync) the run has.
    what: the noun for the message, e.g. "async workers".

  Raises:
    UserError: a bad spec, or an index outside [0, num_workers).
  """
  straggler = parse(spec)
  if straggler is not None and straggler.worker >= num_workers:
    raise UserError(
        f"--straggler={spec} names worker {straggler.worker}, but the run has "
        f"{num_workers} {what} (0..{num_workers - 1}); use "
        f"--straggler={num_workers - 1}:{straggler.factor:g}")


def sleep(seconds: float, stop: Optional[threading.Event] = None) -> None:
  """Sleeps `seconds`, returning early if `stop` is set."""
  if seconds <= 0:
    return
  if stop is None:
    time.sleep(seconds)
  else:
    stop.wait(seconds)


def straggler_option():
  """The `--straggler` option, declared alike by the modes that take it."""
  return option(None, "WORKER:FACTOR makes one worker (async) or replica "
                f"(sync) FACTOR times slower (1 to {MAX_FACTOR:g}), e.g. 1:3; "
                "for research and benchmarks.")
