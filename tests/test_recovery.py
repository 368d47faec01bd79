"""The non-finite policy (dist_loop/control/recovery.py) driven by the controller
over fakes (tests/controller_fakes.py): raise, rollback, --max_rollbacks,
--max_loss's wording, and the stop after too many skipped steps in a row."""

import pytest

from controller_fakes import EXAMPLES_PER_STEP
from controller_fakes import run as _run
from dist_loop.control.actions import Loop
from dist_loop.control.recovery import NonFinitePolicy
from dist_loop.core.config import Config
from dist_loop.core.errors import NonFiniteError, UserError


def _events(log, kind):
  return [e[1] for e in log if e[0] == kind]


def test_raise_stops_at_the_step(tmp_path):
  run = _run(tmp_path, nan=[13])
  assert isinstance(run.result, NonFiniteError) and run.result.step == 13
  assert run.scalar["nonfinite/at_step"] == {13: 13}
  assert run.trainer.restores == 0 and not _events(run.log, "restore")
  assert not (tmp_path / "summary.json").exists()


def test_max_loss_names_the_bound(tmp_path):
  run = _run(tmp_path, nan=[13], max_loss=50.0)
  assert isinstance(run.result, NonFiniteError)
  assert str(run.result).startswith("a loss above --max_loss=50, or "
                                    "non-finite values, at step 13")


def test_skip_counts_the_skipped_steps_and_not_their_updates(tmp_path):
  run = _run(tmp_path, nonfinite="skip", skip=[7, 8, 14])
  assert run.result["skipped_steps"] == 3
  assert run.scalar["nonfinite/skipped_steps"] == {5: 0, 10: 2, 15: 3, 20: 3}
  at10 = {k: v[10] for k, v in run.scalar.items() if 10 in v}
  assert at10["train/updates_per_sec"] == pytest.approx(
      at10["train/steps_per_sec"] * 3 / 5)
  # Steady state (the first loop, which traces, excluded): steps 2-20,
  # 19 steps of which 16 applied.
  assert run.result["updates_per_sec"] == pytest.approx(
      run.result["examples_per_sec"] / EXAMPLES_PER_STEP * 16 / 19)


def test_rollback_restores_the_last_checkpoint_and_goes_on(tmp_path):
  run = _run(tmp_path, nonfinite="rollback", nan=[13])
  assert run.result["final_step"] == 20 and run.result["rollbacks"] == 1
  assert run.trainer.restores == 1
  restore = run.log.index(("restore", 10))
  assert run.log[restore - 1] == ("train", 10, 5)  # Failed at 13,
  assert run.log[restore + 1] == ("train", 10, 5)  # replayed from 10.
  assert run.scalar["nonfinite/at_step"] == {13: 13}
  assert run.scalar["nonfinite/rollbacks"] == {13: 1}


def test_rollback_gives_up_after_max_rollbacks(tmp_path):
  run = _run(tmp_path, nonfinite="rollback", nan=[13], nan_times=10,
             max_rollbacks=2)
  assert isinstance(run.result, UserError)
  assert "at step 13 after 2 rollbacks" in str(run.result)
  assert run.trainer.restores == 2 and len(_events(run.log, "restore")) == 2


def test_rollback_needs_a_checkpoint(tmp_path):
  result = _run(tmp_path, nonfinite="rollback", nan=[3]).result
  assert isinstance(result, UserError)
  assert "no checkpoint to roll back to" in str(result)


# -- skipped steps in a row --


def test_a_run_that_keeps_skipping_stops_naming_step_count_and_fix(tmp_path):
  # Steps 4 on are all skipped; loops end at 1, 5, 10, 15, ...
  run = _run(tmp_path, nonfinite="skip", skip=range(4, 100),
             train_steps=40, max_consecutive_skips=10)
  assert isinstance(run.result, UserError)
  assert not isinstance(run.result, NonFiniteError)
  message = str(run.result)
  # 2 skipped in the loop to 5 (after step 3), then 5 and 5: 12 at step 15.
  assert message.startswith("12 steps in a row up to step 15 were skipped")
  assert "--max_consecutive_skips=10" in message
  assert "--learning_rate" in message and "mixed_bfloat16" in message
  assert max(e[1] + e[2] for e in run.log if e[0] == "train") == 15
  assert not (tmp_path / "summary.json").exists()


def test_exactly_the_bound_in_a_row_goes_on(tmp_path):
  run = _run(tmp_path, nonfinite="skip", skip=range(6, 16),
             max_consecutive_skips=10)
  assert run.result["final_step"] == 20 and run.result["skipped_steps"] == 10


def _loop(steps, skipped, skipped_at_end):
  return Loop(0, steps, {}, skipped, steps, 1.0, skipped_at_end)


def test_an_applied_update_resets_the_count():
  policy = NonFinitePolicy(Config(workdir="w", max_consecutive_skips=5),
                           None, None, None)
  policy.observe(_loop(5, 5, 5))  # Nothing applied: 5 in a row.
  assert policy.skipped_in_a_row == 5
  policy.observe(_loop(5, 4, 1))  # Applied one, then skipped 1.
  assert policy.skipped_in_a_row == 1
  policy.observe(_loop(4, 4, 4))  # 5 in a row: the bound, not above it.
  with pytest.raises(UserError, match="^6 steps in a row up to step 1 "):
    policy.observe(_loop(1, 1, 1))
  assert policy.summary() == {"rollbacks": 0}
