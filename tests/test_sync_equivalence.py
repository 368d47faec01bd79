"""N devices against 1: the same examples per step must give the same
variables.

This is what catches a gradient reduced twice (4x the update), not at all
(each replica on its own quarter, diverging), a loss scaled to the
per-replica instead of the global batch, or a regularisation term counted
once per replica or micro-batch instead of once per step.
"""

from conftest import max_diff
from helpers import initial_and_trained
from test_step import REGULARISED_MODEL  # Registers the model.

STEPS = 12


def _train(config):
  """(initial, trained) variables of `STEPS` steps of `config`."""
  return initial_and_trained(config, STEPS)


def test_four_devices_equal_one(small_config):
  """SGD: unlike Adam, it shows a gradient off by a constant factor."""
  common = dict(optimizer="sgd", learning_rate=0.1)
  start, one = _train(small_config(num_devices=1, **common))
  _, four = _train(small_config(num_devices=4, **common))
  assert max_diff(one, four) <= 1e-5
  # Training moved the variables well beyond the tolerance, so the equality
  # above is not two untouched initialisations.
  assert max_diff(one, start) > 1e-2


def test_regularisation_is_shared_by_replicas_and_micro_batches(
    small_config):
  """2 replicas x 2 micro-batches of 16 are 4 contributors to a step of 64
  examples; each adds a quarter of the penalty. Adam: its slots are
  mirrored like the variables and must move once per step."""
  common = dict(model=REGULARISED_MODEL, optimizer="adam",
                learning_rate=0.01)
  start, one = _train(small_config(num_devices=1, global_batch_size=64,
                                   **common))
  _, split = _train(small_config(num_devices=2, global_batch_size=32,
                                 grad_accum_steps=2, **common))
  assert max_diff(one, split) <= 1e-5
  assert max_diff(one, start) > 1e-2
