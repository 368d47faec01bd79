"""Learning-rate schedules: the rate as a pure function of the step.

`--lr_schedule=NAME` picks a registered schedule, `--warmup_steps=W` ramps
any of them in linearly, and each schedule's own options
(`--lr_final_fraction`, `--lr_decay_steps`, `--lr_boundaries`,
`--lr_factors`) are flags generated from its `Options`, like a mode's.

Why a pure function of the step, and not Keras' `LearningRateSchedule` or
a rate kept in a variable: the optimizer's `_learning_rate` is a checkpointed
variable, so a rate kept there comes back from the checkpoint over the
flags. Computed from the step every update, the rate is the flags' after a
resume or a rollback, and the same at the same step in every mode and at
every replica and process count. `rate(step)` is the rate of the update
numbered `step` (1-based: the value the step counter reaches with it; in
async and ps the counter of applied updates). Its float32 value is
computed in float64 and rounded once, the same on the host (the `Log`
action's `train/learning_rate`) as in the traced step.

An extension adds a schedule in one file:

    @SCHEDULES.register("my_decay")
    def my_decay(step, options, warmup_steps, train_steps):
      return 1.0 / (1.0 + step / 1000.0)

`fn(step, options, warmup_steps, train_steps)` returns the factor on
`--learning_rate` (`step` a float64 tensor; `options` the instance of
`fn.Options`, or None), or None for no factor; the warm-up factor
min(1, step / W) multiplies it (`experiments/extensions/exp_decay.py`).
"""

import dataclasses
import math
from typing import Callable, Tuple

import tensorflow as tf

from dist_loop.core.errors import UserError
from dist_loop.core.options import MAX_FLOAT, option, show
from dist_loop.core.registry import Registry

SCHEDULES: Registry = Registry("learning-rate schedule", "lr_schedule")

# The last step a boundary (or --lr_decay_steps) may name: any count of steps
# (`config.MAX_STEPS`); above int64, the step comparison cannot hold it.
MAX_BOUNDARY = 2**31 - 1

_FINAL = ("Cosine and linear decay: the rate at the end of the decay, as a "
          "fraction of --learning_rate.")
_DECAY = ("Cosine and linear decay: the step the decay ends at (the rate is "
          "--lr_final_fraction after it); 0: --train_steps.")


@dataclasses.dataclass(frozen=True)
class DecayOptions:
  """The options of `linear` and `cosine` (declared alike: one flag each)."""
  lr_final_fraction: float = option(0.0, _FINAL, lower=0.0, upper=1.0)
  lr_decay_steps: int = option(0, _DECAY, lower=0, upper=MAX_BOUNDARY)


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """The options of `step`: piecewise-constant factors."""
  lr_boundaries: str = option(
      "", "Step decay: steps, increasing, after which the rate changes, "
      "e.g. 3000,6000.")
  lr_factors: str = option(
      "", "Step decay: the factor on --learning_rate after each boundary, "
      "one per boundary, e.g. 0.1,0.01.")


@SCHEDULES.register("constant")
def constant(step, options, warmup_steps, train_steps):
  """--learning_rate at every step (after any warm-up)."""
  del step, options, warmup_steps, train_steps
  return None  # No factor: the rate is exactly the flag's.


def _progress(step, options: DecayOptions, train_steps: int, warmup: int):
  """How far the decay is, 0 at the warm-up's end to 1 at its last step."""
  end = options.lr_decay_steps or train_steps
  span = max(end - warmup, 1)
  return tf.clip_by_value((step - warmup) / span, 0.0, 1.0)


@SCHEDULES.register("linear")
def linear(step, options, warmup_steps, train_steps):
  """From 1 down to --lr_final_fraction, linearly, after the warm-up."""
  final = options.lr_final_fraction
  progress = _progress(step, options, train_steps, warmup_steps)
  return 1.0 - (1.0 - final) * progress


@SCHEDULES.register("cosine")
def cosine(step, options, warmup_steps, train_steps):
  """From 1 down to --lr_final_fraction along half a cosine (Loshchilov and
  Hutter, 2017, without restarts), after the warm-up."""
  final = options.lr_final_fraction
  progress = _progress(step, options, train_steps, warmup_steps)
  return final + (1.0 - final) * 0.5 * (1.0 + tf.cos(math.pi * progress))


@SCHEDULES.register("inverse_sqrt")
def inverse_sqrt(step, options, warmup_steps, train_steps):
  """1 until the warm-up's end W, then sqrt(W / step) (Vaswani et al.,
  2017); with no warm-up, 1 / sqrt(step)."""
  del options, train_steps
  knee = float(max(warmup_steps, 1))
  return tf.sqrt(knee / tf.maximum(step, knee))


@SCHEDULES.register("step")
def step_decay(step, options, warmup_steps, train_steps):
  """1, then each --lr_factors value after its --lr_boundaries step."""
  del warmup_steps, train_steps
  boundaries, factors = parse_steps(options)
  factor = tf.constant(1.0, tf.float64)
  for boundary, value in zip(boundaries, factors):
    factor = tf.where(step > boundary, tf.constant(value, tf.float64), factor)
  return factor


linear.Options = cosine.Options = DecayOptions
step_decay.Options = StepOptions


def parse_steps(options: StepOptions) -> Tuple[Tuple[int, ...],
                                               Tuple[float, ...]]:
  """The boundaries and factors of `step`. Raises UserError."""
  try:
    boundaries = tuple(int(b) for b in _items(options.lr_boundaries))
    factors = tuple(float(f) for f in _items(options.lr_factors))
  except ValueError:
    raise UserError(
        f"--lr_boundaries={options.lr_boundaries!r} and --lr_factors="
        f"{options.lr_factors!r} must be comma-separated numbers with no "
        "empty entry, e.g. "
        "--lr_boundaries=3000,6000 --lr_factors=0.1,0.01") from None
  if not boundaries or len(boundaries) != len(factors):
    raise UserError(
        f"--lr_schedule=step needs one --lr_factors value per --lr_boundaries "
        f"step, got {len(boundaries)} boundaries and {len(factors)} factors; "
        "e.g. --lr_boundaries=3000,6000 --lr_factors=0.1,0.01")
  if (list(boundaries) != sorted(set(boundaries)) or boundaries[0] < 1
      or boundaries[-1] > MAX_BOUNDARY):
    raise UserError(f"--lr_boundaries={options.lr_boundaries} must be "
                    f"increasing steps in [1, {MAX_BOUNDARY}]")
  if any(not 0.0 <= f <= MAX_FLOAT for f in factors):
    raise UserError(f"--lr_factors={options.lr_factors} must be finite "
                    f"numbers in [0, {show(MAX_FLOAT)}]")
  return boundaries, factors


def _items(text: str):
  """The comma-separated entries of `text` (none if it is blank). Raises
  ValueError on an empty entry ("5,,6": a typo, not two boundaries)."""
  if not text.strip():
    return []
  items = [p.strip() for p in text.split(",")]
  if not all(items):
    raise ValueError(text)
  return items


class Schedule:
  """The run's rate: `rate(step)` for the update numbered `step`.

  Args:
    learning_rate: the peak rate (--learning_rate).
    name: the registered schedule; options: its options (or None).
    warmup_steps: linear warm-up: step s (1-based) gets s / W of the rate.
    train_steps: the run's length (the default end of a decay).
  """

  def __init__(self, learning_rate: float, name: str = "constant",
               options=None, warmup_steps: int = 0, train_steps: int = 1):
    self.fn: Callable = SCHEDULES.get(name)
    self.learning_rate = learning_rate
    self.name = name
    self.options = options
    self.warmup_steps = warmup_steps
    self.train_steps = train_steps
    if isinstance(options, StepOptions):
      parse_steps(options)

  def rate(self, step) -> tf.Tensor:
    """The float32 rate of update `step` (an int or an integer tensor)."""
    peak = tf.constant(self.learning_rate, tf.float64)
    step = tf.cast(step, tf.float64)
    factor = self.fn(step, self.options, self.warmup_steps, self.train_steps)
    if factor is None and not self.warmup_steps:
      return tf.constant(self.learning_rate, tf.float32)
    rate = peak if factor is None else peak * tf.cast(factor, tf.float64)
    if self.warmup_steps:
      rate *= tf.minimum(step / self.warmup_steps, 1.0)
    return tf.cast(rate, tf.float32)

  def value(self, step: int) -> float:
    """`rate(step)` on the host, as a Python float."""
    return float(self.rate(tf.constant(step, tf.int64)).numpy())


def make(config) -> Schedule:
  """The schedule a `Config` names (its `lr_schedule`, `schedule_options`,
  `warmup_steps`, `learning_rate` and `train_steps`)."""
  return Schedule(config.learning_rate, config.lr_schedule,
                  config.schedule_options, config.warmup_steps,
                  config.train_steps)


def check(config) -> None:
  """The schedule's rules beyond its options' bounds (a warm-up longer
  than the run is allowed: a short trial of a long run's flags). Raises
  UserError."""
  make(config)
