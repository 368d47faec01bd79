"""Learning-rate schedules: their shapes, one rate on the host and in the
trace, an extension registered from a file, the rate in TensorBoard and
summary.json, and the refusals.

That every mode applies the same rate at the same step is
test_clipping.py's (cosine with warm-up, every mode equal to one device).
"""

import importlib.util
import json
import math
import os

import numpy as np
import pytest
import tensorflow as tf

from conftest import read_events
from dist_loop import configure, make_config, train
from dist_loop.core.errors import UserError
from dist_loop.runtime.cluster import Cluster
from dist_loop.training import schedules
from dist_loop.training.schedules import DecayOptions, Schedule, StepOptions
from experiments import flags as run_flags
from experiments.extensions import exp_decay  # noqa: F401  (registers it)


def _rates(schedule, steps):
  return [schedule.value(s) for s in steps]


def test_warmup_ramps_every_schedule_in_then_each_decays_its_way():
  lr = 0.5
  constant = Schedule(lr, "constant", warmup_steps=4, train_steps=20)
  assert _rates(constant, [1, 2, 4, 5, 20]) == pytest.approx(
      [lr / 4, lr / 2, lr, lr, lr])
  cosine = Schedule(lr, "cosine", DecayOptions(lr_final_fraction=0.2),
                    warmup_steps=4, train_steps=24)
  # Peak at the warm-up's end, half-way between peak and floor at the
  # decay's middle, the floor at its end and after.
  assert _rates(cosine, [4, 14, 24, 30]) == pytest.approx(
      [lr, lr * 0.6, lr * 0.2, lr * 0.2])
  linear = Schedule(lr, "linear", DecayOptions(lr_decay_steps=10),
                    train_steps=100)
  assert _rates(linear, [0, 5, 10, 50]) == pytest.approx(
      [lr, lr / 2, 0.0, 0.0])
  inverse = Schedule(lr, "inverse_sqrt", warmup_steps=4, train_steps=100)
  assert _rates(inverse, [2, 4, 16, 64]) == pytest.approx(
      [lr / 2, lr, lr / 2, lr / 4])
  step = Schedule(lr, "step", StepOptions("3,6", "0.1,0.01"),
                  train_steps=10)
  assert _rates(step, [3, 4, 6, 7]) == pytest.approx(
      [lr, lr * 0.1, lr * 0.1, lr * 0.01])


def test_the_traced_rate_is_the_hosts_and_a_constant_is_the_flags_float32():
  schedule = Schedule(3e-4, "cosine", DecayOptions(0.1), warmup_steps=7,
                      train_steps=50)
  traced = tf.function(lambda s: tf.map_fn(schedule.rate, s,
                                           fn_output_signature=tf.float32),
                       autograph=False)
  steps = np.arange(1, 60, dtype=np.int64)
  np.testing.assert_array_equal(traced(tf.constant(steps)).numpy(),
                                np.float32(_rates(schedule, steps)))
  assert schedule.value(7) == np.float32(3e-4)  # Exactly the peak.
  flat = Schedule(1e-3)
  assert flat.value(12345) == np.float32(1e-3)


def test_an_extension_schedule_is_one_file(tmp_path):
  """A schedule with an option, registered by a file of its own: its flag
  is generated, and it is refused for a run that chose another schedule."""
  path = tmp_path / "my_schedule.py"
  path.write_text(
      "import dataclasses\n"
      "from dist_loop.core.options import option\n"
      "from dist_loop.training.schedules import SCHEDULES\n\n"
      "@dataclasses.dataclass(frozen=True)\n"
      "class Options:\n"
      "  my_floor: float = option(0.25, 'The factor.', lower=0.0)\n\n"
      "@SCHEDULES.register('test_floor')\n"
      "def floor(step, options, warmup_steps, train_steps):\n"
      "  return options.my_floor + 0.0 * step\n\n"
      "floor.Options = Options\n")
  spec = importlib.util.spec_from_file_location("my_schedule", path)
  spec.loader.exec_module(importlib.util.module_from_spec(spec))
  run_flags.define_component_flags()  # As at import, for the new one.
  assert run_flags.FLAGS["my_floor"].default == 0.25
  config = configure.validate(make_config(
      workdir=str(tmp_path / "w"), lr_schedule="test_floor", my_floor=0.5,
      learning_rate=2.0, warmup_steps=2), Cluster())
  assert schedules.make(config).value(1) == pytest.approx(0.5)  # Warm-up.
  assert schedules.make(config).value(9) == pytest.approx(1.0)
  with pytest.raises(UserError, match="--lr_schedule=test_floor"):
    make_config(workdir="w", my_floor=0.5)  # Not the chosen schedule.


def test_the_rate_is_logged_and_summarised_as_the_schedule_gives_it(
    small_config):
  """The worked example `exp_decay`, end to end: TensorBoard's
  train/learning_rate at each logged step and summary.json's last."""
  config = small_config(lr_schedule="exp_decay", lr_half_life=3,
                        warmup_steps=2, train_steps=8, steps_per_loop=2,
                        log_every=2, checkpoint_every=8, eval_every=8)
  summary = train.run(config)
  logged = read_events(os.path.join(config.workdir, "tb"))[
      "train/learning_rate"]
  expected = {s: 0.1 * min(1.0, s / 2) * 0.5 ** (max(s - 2, 0) / 3)
              for s in logged}
  assert sorted(logged) == [2, 4, 6, 8]
  assert logged == pytest.approx(expected)
  assert summary["train_learning_rate"] == pytest.approx(expected[8])
  with open(os.path.join(config.workdir, "summary.json")) as f:
    assert json.load(f)["train_learning_rate"] == pytest.approx(expected[8])
  assert math.isclose(expected[8], 0.025, rel_tol=1e-6)


@pytest.mark.parametrize("flat,message", [
    (dict(lr_schedule="step", lr_boundaries="5", lr_factors="0.1,0.01"),
     "one --lr_factors value per --lr_boundaries step"),
    (dict(lr_schedule="step", lr_boundaries="6,3", lr_factors="0.1,0.01"),
     "must be increasing"),
    (dict(lr_schedule="step", lr_boundaries="a", lr_factors="0.1"),
     "comma-separated numbers"),
    (dict(lr_schedule="step", lr_boundaries="5,,6", lr_factors="0.1,0.2"),
     "with no empty entry"),
    (dict(lr_schedule="step", lr_boundaries="5,6", lr_factors="0.1,,0.2"),
     "with no empty entry"),
    (dict(lr_schedule="step", lr_boundaries="99999999999999999999",
          lr_factors="0.1"), r"increasing steps in \[1, 2147483647\]"),
    (dict(lr_schedule="step", lr_boundaries="5", lr_factors="1e39"),
     r"--lr_factors=1e39 must be finite numbers in \[0, 1e\+30\]"),
    (dict(weight_decay=-0.5), "must be >= 0, or -1"),
    (dict(lr_schedule="cosin"), "unknown --lr_schedule='cosin'"),
    (dict(lr_final_fraction=0.1), "--lr_schedule=cosine or "),
])
def test_bad_schedules_are_refused_in_one_line(small_config, flat, message):
  with pytest.raises(UserError, match=message) as error:
    configure.validate(small_config(**flat), Cluster())
  assert "\n" not in str(error.value)
