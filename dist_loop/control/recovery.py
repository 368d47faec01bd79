"""What a run does when its steps go bad: `--nonfinite`, `--max_loss`,
`--max_rollbacks` and `--max_consecutive_skips`.

A mode's `train(n)` raises `NonFiniteError` at a step whose loss or
gradients were not finite (or whose loss was above `--max_loss`) and that it
could not skip. Then:

- `raise` (the default): the run stops with that error, naming the step;
- `rollback`: the newest readable checkpoint is restored and the run goes
  on from it, at most `--max_rollbacks` times;
- `skip`: the mode itself drops such a step's update and counts it.

Skipping can go on for ever (a float16 run whose loss scale keeps
overflowing, a learning rate that makes every gradient infinite) and would
then end with a model no step changed. So skipped steps are counted in a
row, across inner loops, and more than `--max_consecutive_skips` of them
stop the run with one line.
"""

from typing import Dict

from absl import logging

from dist_loop.control.actions import Loop
from dist_loop.core.errors import NonFiniteError, UserError


class NonFinitePolicy:
  """The controller's `recovery`: `recover` after a `NonFiniteError`,
  `observe` after every inner loop.

  Args:
    config: the run's `Config` (`nonfinite`, `max_loss`, `max_rollbacks`,
      `max_consecutive_skips`).
    checkpointer: has `restore(scope) -> path or None`.
    trainer: has `scope()` and `on_restore()`.
    summaries: `Summaries` (`nonfinite/at_step`, `nonfinite/rollbacks`).
  """

  def __init__(self, config, checkpointer, trainer, summaries):
    self._config = config
    self._checkpointer = checkpointer
    self._trainer = trainer
    self._summaries = summaries
    self.rollbacks = 0
    self.skipped_in_a_row = 0

  def recover(self, error: NonFiniteError) -> None:
    """Restores the newest checkpoint (--nonfinite=rollback) or raises.

    Raises:
      NonFiniteError: `error`, unless the policy is rollback.
      UserError: rollbacks exhausted, or nothing to roll back to.
    """
    cfg = self._config
    what = ("non-finite loss or gradients" if not cfg.max_loss else
            f"a loss above --max_loss={cfg.max_loss:g}, or non-finite values,")
    if cfg.max_loss:  # The mode does not say which of the two it was.
      error.args = (f"{what} at step {error.step}; lower --learning_rate, or "
                    "check the input data",)
    self._summaries.scalars(error.step, {"nonfinite/at_step": error.step})
    if cfg.nonfinite != "rollback":
      raise error
    self.rollbacks += 1
    self._summaries.scalars(error.step,
                            {"nonfinite/rollbacks": self.rollbacks})
    if self.rollbacks > cfg.max_rollbacks:
      raise UserError(
          f"{what} at step {error.step} after {cfg.max_rollbacks} rollbacks "
          "(--max_rollbacks); lower --learning_rate, or check the input data"
          ) from None
    path = self._checkpointer.restore(self._trainer.scope())
    if path is None:
      raise UserError(f"{what} at step {error.step} and no checkpoint to "
                      "roll back to yet; lower --checkpoint_every or "
                      "--learning_rate") from None
    self._trainer.on_restore()
    self.skipped_in_a_row = 0
    logging.warning("%s at step %d: rolled back to %s (rollback %d of at "
                    "most %d).", what[0].upper() + what[1:].rstrip(","),
                    error.step, path, self.rollbacks, cfg.max_rollbacks)

  def observe(self, loop: Loop) -> None:
    """Counts skipped steps in a row.

    Raises:
      UserError: more than --max_consecutive_skips in a row.
    """
    if loop.updates:
      self.skipped_in_a_row = loop.skipped_at_end
    else:
      self.skipped_in_a_row += loop.skipped_at_end
    limit = self._config.max_consecutive_skips
    if self.skipped_in_a_row > limit:
      raise UserError(
          f"{self.skipped_in_a_row} steps in a row up to step {loop.end} were "
          "skipped (non-finite gradients, or float16 overflows), more than "
          f"--max_consecutive_skips={limit}; nothing is being learned. Lower "
          "--learning_rate (with --precision=mixed_float16, try "
          "mixed_bfloat16)")

  def summary(self) -> Dict[str, int]:
    """summary.json's `rollbacks`."""
    return {"rollbacks": self.rollbacks}
