"""Checkpoints every `--checkpoint_every` steps, at the end, and when the run
is stopped early (SIGTERM, Ctrl-C), so a rerun resumes where it stopped."""

from dist_loop.control.actions.base import Action


class Checkpoint(Action):
  """Saves through `checkpoints.Checkpointer.save(step)` (a no-op when the
  latest checkpoint already is of `step`); at `last_step` and when stopped
  early it also waits for a background save to be complete (`wait()`)."""

  at_end = True
  phase = "checkpoint"

  def __init__(self, every: int, checkpointer, last_step: int = 0):
    self.every = every
    self._checkpointer = checkpointer
    self._last_step = last_step

  def __call__(self, step: int) -> None:
    self._checkpointer.save(step)
    if step >= self._last_step:  # The run ends: its last save is complete.
      self._checkpointer.wait()

  def interrupted(self, step: int) -> None:
    self._checkpointer.save(step)
    self._checkpointer.wait()
