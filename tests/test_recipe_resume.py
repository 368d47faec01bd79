"""A resume honours the recipe flags meant to change, from the resumed step.

The learning rate is the schedule's at the step, never the checkpoint's
`optimizer/_learning_rate`: a run resumed at step 4 with five times the
rate equals one run with a step schedule that multiplies it by five after
step 4, on two replicas with ZeRO-2, also when the resumed run rolls back
to the checkpoint written at the old rate (`--nonfinite=rollback`). A
changed optimizer is refused in one line naming both, and with
--allow_config_change starts its slots fresh.
"""

import logging
import os
import shutil

import pytest
import tensorflow as tf

from conftest import checkpoint_variables, max_diff
from dist_loop import train
from dist_loop.core.errors import NonFiniteError, UserError
from dist_loop.parallel.modes.sync import SyncTrainer

LR = 0.01
RUN = dict(num_devices=2, shard="gradients", optimizer="adam",
           learning_rate=LR, steps_per_loop=2, log_every=2,
           checkpoint_every=4, eval_every=8)
_ITERATIONS = "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"
_RATE = "optimizer/_learning_rate/.ATTRIBUTES/VARIABLE_VALUE"


def _latest(config):
  return tf.train.latest_checkpoint(os.path.join(config.workdir,
                                                 "checkpoints"))


@pytest.fixture(name="half", scope="module")
def _half(tmp_path_factory):
  """A workdir trained 4 steps at LR (its ckpt-4), to copy."""
  from dist_loop import make_config  # pylint: disable=g-import-not-at-top
  workdir = tmp_path_factory.mktemp("recipe") / "half"
  config = make_config(workdir=str(workdir), dataset="synthetic",
                       model="mlp", global_batch_size=32, seed=0,
                       train_steps=4, **RUN)
  train.run(config)
  return workdir


def _copy(half, tmp_path, name):
  shutil.copytree(half, tmp_path / name)
  return str(tmp_path / name)


def test_a_changed_rate_applies_from_the_resumed_step_even_after_rollback(
    small_config, half, tmp_path, monkeypatch, caplog):
  reference = small_config(workdir=str(tmp_path / "reference"),
                           train_steps=8, lr_schedule="step",
                           lr_boundaries="4", lr_factors="5", **RUN)
  train.run(reference)
  caplog.set_level(logging.INFO, logger="absl")
  resumed = small_config(workdir=_copy(half, tmp_path, "resumed"),
                         train_steps=8, **dict(RUN, learning_rate=5 * LR))
  train.run(resumed)
  assert ("changed since the checkpoint: --train_steps: 4 -> 8; "
          "--learning_rate: 0.01 -> 0.05\n") in caplog.text
  assert max_diff(checkpoint_variables(reference),
                  checkpoint_variables(resumed)) <= 1e-6
  assert max_diff(checkpoint_variables(resumed),
                  checkpoint_variables(resumed.replace(
                      workdir=str(half)))) > 1e-3  # It trained on.
  # The checkpoint shows the rate of its last update, the flags'.
  assert tf.train.load_variable(_latest(resumed), _RATE) == pytest.approx(
      5 * LR)

  original, calls = SyncTrainer.train, []

  def flaky(self, n):  # The second loop (steps 7-8) fails once, after its
    calls.append(n)    # updates: the rollback restores ckpt-4 (rate LR).
    out = original(self, n)
    if len(calls) == 2:
      raise NonFiniteError(int(self.step.numpy()))
    return out

  monkeypatch.setattr(SyncTrainer, "train", flaky)
  rolled = resumed.replace(workdir=_copy(half, tmp_path, "rolled"),
                           nonfinite="rollback")
  summary = train.run(rolled)
  assert summary["rollbacks"] == 1 and summary["final_step"] == 8
  assert max_diff(checkpoint_variables(reference),
                  checkpoint_variables(rolled)) <= 1e-6


def test_a_changed_optimizer_is_refused_unless_allowed_then_starts_fresh(
    small_config, half, tmp_path, caplog):
  config = small_config(workdir=_copy(half, tmp_path, "other"),
                        train_steps=8, **dict(RUN, optimizer="momentum"))
  flags_path = os.path.join(config.workdir, "flags.txt")
  with open(flags_path) as f:
    before = f.read()
  with pytest.raises(UserError) as error:
    train.run(config)
  message = str(error.value)
  assert "--optimizer=adam" in message and "--optimizer=momentum" in message
  assert "--allow_config_change" in message and "\n" not in message
  with open(flags_path) as f:
    assert f.read() == before  # Refused before touching anything.
  caplog.set_level(logging.INFO, logger="absl")
  summary = train.run(config.replace(allow_config_change=True))
  assert summary["final_step"] == 8
  assert ("--optimizer: adam -> momentum (its slots start fresh)"
          in caplog.text)
  # Momentum's slots and counter started at step 4: 4 updates, not 8.
  assert tf.train.load_variable(_latest(config), _ITERATIONS) == 4


def test_the_changes_line_compares_a_flags_txt_from_before_the_recipe():
  """A flags.txt written before the recipe flags existed: a flag it lacks
  counts as its default (then constant), so only real changes are named."""
  from dist_loop import make_config  # pylint: disable=g-import-not-at-top
  old = make_config(workdir="w", learning_rate=0.01)
  text = "".join(line + "\n" for line in old.to_flagfile().splitlines()
                 if not line.startswith(("--lr_schedule", "--warmup_steps",
                                         "--clip_global_norm",
                                         "--weight_decay")))
  new = make_config(workdir="w", learning_rate=0.01, lr_schedule="cosine",
                    lr_final_fraction=0.1, clip_global_norm=1.0,
                    allow_config_change=True)
  assert new.changes(text) == ["--lr_schedule: constant -> cosine",
                               "--clip_global_norm: 0.0 -> 1.0"]
  assert old.changes(text) == [] and old.optimizer_change(text) is None
  assert new.replace(optimizer="sgd").optimizer_change(text) == "adam"
