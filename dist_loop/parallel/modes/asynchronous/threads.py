"""Threads that stop together: one stop flag, bounded waits, the first error.

The async mode's threads hand work to one another through queues and events.
Every blocking call of a `Crew` waits at most `POLL_SECONDS` at a time and
looks at the stop flag in between, so setting the flag (a failure in any
thread, Ctrl-C in the main thread, `close`) ends every wait within one poll.
The first failure is kept, names its thread, and is raised by `check` in the
main thread; `close` joins the threads with a deadline.
"""

import queue
import threading
import time
from typing import Callable, List, Optional

from absl import logging

POLL_SECONDS = 0.05  # How often a blocked call looks at the stop flag.
JOIN_SECONDS = 10.0  # How long `close` waits for all threads together.


class WorkerFailed(RuntimeError):
  """A thread of the crew raised; every thread was stopped."""

  def __init__(self, thread: str, error: BaseException):
    self.thread = thread
    super().__init__(f"{thread} failed: {type(error).__name__}: {error}")


class Stopped(Exception):
  """A blocking call ended because the stop flag was set."""


class _NotYet(Exception):
  """An event wait timed out (the event counterpart of queue.Empty)."""


class Crew:
  """A set of daemon threads sharing one stop flag and one failure slot."""

  def __init__(self):
    self.stop = threading.Event()
    self._failure: Optional[WorkerFailed] = None
    self._failure_lock = threading.Lock()
    self._threads: List[threading.Thread] = []

  def start(self, name: str, label: str, loop: Callable, *args) -> None:
    """Runs `loop(*args)` in a new thread `name` until it returns, is
    stopped, or fails (then the failure, named `label`, stops the crew)."""
    thread = threading.Thread(target=self._guard, args=(label, loop) + args,
                              name=name, daemon=True)
    self._threads.append(thread)
    thread.start()

  # -- the bounded, stop-aware waits --

  def get(self, q: queue.Queue):
    """The next item of `q`. Raises Stopped."""
    return self._poll(lambda timeout: q.get(timeout=timeout))

  def put(self, q: queue.Queue, item) -> None:
    """Puts `item` into `q`, waiting for room. Raises Stopped."""
    self._poll(lambda timeout: q.put(item, timeout=timeout))

  def wait(self, event: threading.Event) -> None:
    """Waits until `event` is set. Raises Stopped."""

    def attempt(timeout):
      if not event.wait(timeout=timeout):
        raise _NotYet()

    self._poll(attempt)

  def _poll(self, attempt: Callable[[float], object]):
    """`attempt(POLL_SECONDS)` until it returns, checking the flag between
    tries; an attempt that times out raises Empty, Full or _NotYet."""
    while True:
      if self.stop.is_set():
        raise Stopped()
      try:
        return attempt(POLL_SECONDS)
      except (queue.Empty, queue.Full, _NotYet):
        pass

  # -- failure and shutdown --

  def check(self) -> None:
    """Raises the first failure of any thread, if there was one."""
    failure = self._failure
    if failure is not None:
      raise failure from failure.__cause__

  def close(self) -> List[str]:
    """Stops every thread and joins them, JOIN_SECONDS in all. Safe to
    call twice. Returns the names of threads still running (daemons: they
    cannot keep the process alive)."""
    self.stop.set()
    deadline = time.monotonic() + JOIN_SECONDS
    for t in self._threads:
      t.join(timeout=max(deadline - time.monotonic(), 0.0))
    self._threads = [t for t in self._threads if t.is_alive()]
    alive = [t.name for t in self._threads]
    if alive:
      logging.error("threads still running after %.0f s: %s", JOIN_SECONDS,
                    ", ".join(alive))
    return alive

  def _guard(self, label: str, loop: Callable, *args) -> None:
    try:
      loop(*args)
    except Stopped:
      pass
    except BaseException as e:  # pylint: disable=broad-except
      with self._failure_lock:
        if self._failure is None:
          self._failure = WorkerFailed(label, e)
          self._failure.__cause__ = e
      self.stop.set()
