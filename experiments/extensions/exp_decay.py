"""Worked example: a learning-rate schedule as one file.

Exponential decay with a half-life: the rate halves every
`--lr_half_life` steps after the warm-up. The schedule is a function of the
step, so it gives the same rate at the same step in every mode and after a
resume; its option becomes a flag because it is a field of `Options`, and
`--lr_schedule` takes its choices from the registry. Load and select it
with `--user_modules=experiments.extensions.exp_decay
--lr_schedule=exp_decay --lr_half_life=500`.
"""

import dataclasses

import tensorflow as tf

from dist_loop.core.options import option
from dist_loop.training.schedules import SCHEDULES


@dataclasses.dataclass(frozen=True)
class ExpDecayOptions:
  lr_half_life: int = option(
      1000, "exp_decay: steps after the warm-up over which the rate halves.",
      lower=1)


@SCHEDULES.register("exp_decay")
def exp_decay(step, options, warmup_steps, train_steps):
  """0.5 ** ((step - W) / half-life) after the warm-up W; 1 before."""
  del train_steps
  after = tf.maximum(step - warmup_steps, 0.0)
  return 0.5 ** (after / options.lr_half_life)


exp_decay.Options = ExpDecayOptions
