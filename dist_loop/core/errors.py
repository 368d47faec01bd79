"""Errors that are the user's to fix, kept apart from bugs.

The entry point prints a `UserError` as one line and exits with its
`exit_code` (non-zero) without a traceback; anything else is a bug in
dist_loop and keeps its traceback.
"""

from typing import Optional


class UserError(Exception):
  """Bad input (flags, files, data, devices). The message names the fix."""

  exit_code = 1


class NonFiniteError(UserError):
  """The loss or the all-reduced gradients became NaN or Inf at `step`."""

  def __init__(self, step: int):
    self.step = step
    super().__init__(
        f"non-finite loss or gradients at step {step}; the update of that step "
        "was not applied. Lower --learning_rate, or check the input data.")


class DivergedError(UserError):
  """The run finished, but what it learned is garbage (`divergence.py`):
  its checkpoint and summary.json (`"diverged": reason`) were written.

  Exit code 3, so a script that checks for success does not take the run
  for one. `summary` is what summary.json holds.
  """

  exit_code = 3

  def __init__(self, message: str, summary: Optional[dict] = None):
    self.summary = summary
    super().__init__(message)


class Interrupted(UserError):
  """Ctrl-C or SIGTERM. `step` is where the run stopped and `saved` whether
  a checkpoint of it was saved; `step` is None outside the training loop
  (start-up or shut-down), where stopping loses no trained step."""

  EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}

  def __init__(self, step: Optional[int], signal_name: str = "SIGINT",
               saved: bool = True):
    self.step = step
    self.saved = saved
    self.exit_code = self.EXIT_CODES.get(signal_name, 1)
    if step is None:
      what = (f"{signal_name} outside the training loop; no trained step was "
              "lost.")
    elif saved:
      what = f"{signal_name} at step {step}; a checkpoint was saved."
    else:
      what = (f"{signal_name} at step {step} before its checkpoint was saved; "
              "the last saved checkpoint is intact.")
    super().__init__(f"{what} Rerun the same command to resume.")
