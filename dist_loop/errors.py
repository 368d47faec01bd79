"""Errors that are the user's to fix, kept apart from bugs.

The entry point prints a `UserError` as one line and exits non-zero without a
traceback; anything else is a bug in dist_loop and keeps its traceback.
"""


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


class Interrupted(UserError):
  """Ctrl-C or SIGTERM: a checkpoint at `step` was saved; rerunning resumes."""

  EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}

  def __init__(self, step: int, signal_name: str = "SIGINT"):
    self.step = step
    self.exit_code = self.EXIT_CODES.get(signal_name, 1)
    super().__init__(f"{signal_name} at step {step}; a checkpoint was saved. "
                     "Rerun the same command to resume.")
