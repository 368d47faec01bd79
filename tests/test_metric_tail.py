"""The metric tail every mode shares (`modes/base.py: train_metrics`).

Every mode's `train(n)` ends in it, so a task's derived metrics (a language
model's bits per byte) and the skip counts reach TensorBoard under the same
names in every mode: here the tail itself and the ps chief's (a ps run needs
a cluster, so its call's record is built by hand). A real run's tail, an
async Transformer's bits per byte, is checked on the async run of
test_transformer_modes.py (`test_async_one_worker_equals_sync_sgd`), which
builds that trainer anyway.
"""

import math

import numpy as np

from dist_loop.parallel.modes.base import train_metrics
from dist_loop.parallel.modes.ps import stats
from dist_loop.tasks import TASKS
from dist_loop.training.precision import DynamicLossScale

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

