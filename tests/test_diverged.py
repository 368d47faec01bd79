"""No garbage success: a run that diverged ends with exit code 3 and says so
in summary.json; a run that keeps skipping its steps stops.

End to end on the tiny config (SGD at a learning rate of 100 takes the MLP's
loss from 2.4 to about 1e21 in 10 steps), plus the verdict itself
(`dist_loop/control/divergence.py`) on chosen losses, and a non-finite
evaluation through the controller's fakes. That a healthy run is not diverged is
checked on the resumed run of test_sync.py
(test_the_run_leaves_summary_json_and_flags).
"""

import json
import math
import shutil

import pytest

from conftest import run_main
from controller_fakes import run as fake_run
from dist_loop import make_config, train
from dist_loop.control import divergence
from dist_loop.core.errors import DivergedError, NonFiniteError, UserError

DIVERGING = dict(dataset="synthetic", model="mlp", num_devices=1,
                 global_batch_size=32, train_steps=10, optimizer="sgd",
                 learning_rate=100.0, steps_per_loop=5, log_every=5,
                 eval_every=10, checkpoint_every=10, seed=0)


@pytest.fixture(name="diverged", scope="module")
def _diverged(tmp_path_factory):
  """(exit code, stdout, stderr, workdir) of a diverging run of the entry
  point."""
  workdir = tmp_path_factory.mktemp("diverged") / "run"
  code, out, err = run_main(f"--workdir={workdir}", *(
      f"--{k}={v}" for k, v in DIVERGING.items()))
  return code, out, err, workdir


def test_the_entry_point_ends_a_diverged_run_in_one_line_with_code_3(
    diverged):
  code, out, err, _ = diverged
  assert code == 3
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1, err
  assert lines[0].startswith("error: the run diverged: the last logged train "
                             "loss, ")
  assert "times the first step's" in lines[0]
  assert "Its checkpoint of step 10 and summary.json were saved" in lines[0]
  assert "Lower --learning_rate" in lines[0]
  assert "done:" not in out


def test_a_diverged_run_still_saves_its_checkpoint_and_summary(diverged):
  workdir = diverged[3]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["final_step"] == 10
  assert summary["diverged"].startswith("the last logged train loss")
  assert summary["first_train_loss"] == pytest.approx(math.log(10), rel=0.1)
  assert summary["train_loss"] > 1e3 * summary["first_train_loss"]
  assert (workdir / "checkpoints" / "ckpt-10.index").exists()


def test_rerunning_a_diverged_run_trains_nothing_and_stays_diverged(
    diverged, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(diverged[3], workdir)
  before = json.loads((workdir / "summary.json").read_text())
  with pytest.raises(DivergedError) as e:
    train.run(make_config(workdir=str(workdir), **DIVERGING))
  assert e.value.exit_code == 3
  assert e.value.summary["final_step"] == 10
  assert e.value.summary["diverged"] == before["diverged"]
  assert e.value.summary["train_loss"] == before["train_loss"]
  after = json.loads((workdir / "summary.json").read_text())
  assert after["diverged"] == before["diverged"]


def test_a_run_that_keeps_skipping_stops_in_one_line(small_config):
  cfg = small_config(precision="mixed_float16", nonfinite="skip",
                     learning_rate=1e6, max_consecutive_skips=3,
                     train_steps=12, steps_per_loop=4)
  with pytest.raises(UserError) as e:
    train.run(cfg)
  assert not isinstance(e.value, (NonFiniteError, DivergedError))
  assert " steps in a row up to step " in str(e.value)
  assert "--max_consecutive_skips=3" in str(e.value)


# -- the verdict --


@pytest.mark.parametrize("first,last,evaluation,ratio,expected", [
    (2.0, 19.0, {"eval/loss": 1.0}, 10.0, None),
    (2.0, 21.0, {"eval/loss": 1.0}, 10.0, "the last logged train loss, 21, "
     "is 10.5 times the first step's 2 (--diverged_loss_ratio=10)"),
    (2.0, 21.0, {"eval/loss": 1.0}, 0.0, None),  # Turned off.
    (2.0, 21.0, {"eval/loss": 1.0}, 20.0, None),
    (2.0, 1.0, {"eval/loss": math.nan}, 10.0, "the final eval/loss is nan"),
    (2.0, 1.0, {"eval/accuracy": 0.5, "eval/loss": math.inf}, 0.0,
     "the final eval/loss is inf"),  # Always checked.
    (2.0, math.inf, None, 10.0, "the last logged train loss is inf"),
    (None, 50.0, None, 10.0, None),  # No reference: nothing to compare.
    (2.0, None, None, 10.0, None),  # No update applied: no loss.
    (0.0, 5.0, None, 10.0, None),
])
def test_the_verdict(first, last, evaluation, ratio, expected):
  assert divergence.reason(first, last, evaluation, ratio) == expected


def test_a_nonfinite_evaluation_is_a_divergence(tmp_path):
  run = fake_run(tmp_path, eval_value=math.nan)
  assert run.result["diverged"] == "the final eval/loss is nan"
  assert run.result["final_step"] == 20 and run.saved == [10, 20]
  healthy = fake_run(tmp_path / "healthy")
  assert healthy.result["diverged"] is None
