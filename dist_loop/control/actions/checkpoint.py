"""Checkpoints every `--checkpoint_every` steps, at the end, and when the run
is stopped early (SIGTERM, Ctrl-C), so a rerun resumes where it stopped."""

from dist_loop.control.actions.base import Action


class Checkpoint(Action):
  """Saves through `checkpoints.Checkpointer.save(step)` (a no-op when the
  latest checkpoint already is of `step`)."""

  at_end = True

  def __init__(self, every: int, checkpointer):
    self.every = every
    self._checkpointer = checkpointer

  def __call__(self, step: int) -> None:
    self._checkpointer.save(step)

  def interrupted(self, step: int) -> None:
    self._checkpointer.save(step)
