"""The metric tail every mode shares (`modes/base.py: train_metrics`).

Every mode's `train(n)` ends in it, so a task's derived metrics (a language
model's bits per byte) and the skip counts reach TensorBoard under the same
names in every mode: here the tail itself, the ps chief's (a ps run needs a
cluster, so its call's record is built by hand), and a real async run.
"""

import math

import keras
import numpy as np

from dist_loop import configure, data, devices, make_config
from dist_loop.cluster import Cluster
from dist_loop.modes import build_trainer
from dist_loop.modes.base import train_metrics
from dist_loop.modes.ps import stats
from dist_loop.precision import DynamicLossScale
from dist_loop.tasks import TASKS

LM = TASKS.get("language_model")()
LM_NAMES = {"train/loss", "train/accuracy", "train/bits_per_byte",
            "train/grad_norm", "train/skipped_steps",
            "train/skipped_steps_at_end"}


def test_the_tail_reports_the_task_and_names_every_value():
  out = train_metrics(
      LM, {"loss": 2 * math.log(2.0), "accuracy": 0.5, "grad_norm": 3.0,
           "local_sgd/replica_grad_norm": 4.0},
      skipped=2, skipped_at_end=1, extra={"loss_scale": 8.0})
  assert out == {"train/loss": 2 * math.log(2.0), "train/accuracy": 0.5,
                 "train/bits_per_byte": 2.0, "train/grad_norm": 3.0,
                 "local_sgd/replica_grad_norm": 4.0, "train/loss_scale": 8.0,
                 "train/skipped_steps": 2.0,
                 "train/skipped_steps_at_end": 1.0}


def test_without_an_applied_update_there_is_no_loss_to_report():
  assert train_metrics(LM, {}, skipped=3, skipped_at_end=3) == {
      "train/skipped_steps": 3.0, "train/skipped_steps_at_end": 3.0}


def _record(applied, dropped=0, skipped=0):
  """A ps call's stats vector: `applied` updates of loss ln 2 (1 bit),
  accuracy 0.5 and gradient norm 2."""
  layout = stats.Layout(LM.metric_names)
  vector = np.zeros(layout.size)
  vector[:len(stats.COUNTS)] = [applied, dropped, skipped, 0]
  vector[-3:] = np.array([math.log(2.0), 0.5, 2.0]) * applied
  return layout.read(vector)


def test_a_ps_call_reports_bits_per_byte_and_no_skipped_step():
  out = stats.call_metrics(LM, _record(applied=4, dropped=2, skipped=1))
  assert set(out) == LM_NAMES | {"ps/drops_per_update"}
  assert out["train/bits_per_byte"] == 1.0
  assert out["train/grad_norm"] == 2.0
  # An overflowed push does not advance the step: no step was skipped.
  assert out["train/skipped_steps"] == 0.0
  assert out["ps/drops_per_update"] == 0.5


def test_a_ps_call_reports_its_loss_scale():
  scale = DynamicLossScale(initial_scale=64.0)
  assert stats.call_metrics(LM, _record(1), scale)["train/loss_scale"] == 64.0


def test_an_async_transformer_reports_bits_per_byte(tmp_path):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text(" ".join(["alpha", "beta", "gamma"] * 400))
  config = configure.validate(make_config(
      workdir=str(tmp_path / "run"), mode="async", async_workers=1,
      dataset="text", data_file=str(corpus), model="transformer",
      num_layers=1, d_model=8, num_heads=1, mlp_ratio=1, seq_len=8,
      num_devices=1, global_batch_size=8, train_steps=2, seed=0), Cluster())
  keras.utils.set_random_seed(0)
  trainer = build_trainer(config, devices.configure(1, "cpu"),
                          data.load(config), Cluster())
  try:
    out = trainer.train(2)
  finally:
    trainer.close()
  assert LM_NAMES <= set(out)
  assert not any(k.startswith("train/") for k in set(out) - LM_NAMES)
  assert out["train/bits_per_byte"] == out["train/loss"] / math.log(2.0)
  assert out["train/skipped_steps"] == 0.0
