"""N devices against 1: the same examples per step must give the same
variables.

This is what catches a gradient reduced twice (4x the update), not at all
(each replica on its own quarter, diverging), a loss scaled to the
per-replica instead of the global batch, or a regularisation term counted
once per replica or micro-batch instead of once per step. Local SGD
synchronising every step is sync, and is checked here against the same
one-device run.
"""

from conftest import max_diff
import dist_loop.parallel.modes.local_sgd  # noqa: F401  (registers the mode)
from helpers import initial_and_trained, make_trainer, variables
from test_step import REGULARISED_MODEL  # Registers the model.

STEPS = 12


def _train(config):
  """(initial, trained) variables of `STEPS` steps of `config`."""
  return initial_and_trained(config, STEPS)


def test_four_devices_and_local_sgd_at_h1_equal_one(small_config):
  """SGD: unlike Adam, it shows a gradient off by a constant factor.

  One reference for two equalities: sync on 4 devices, and local SGD with
  H=1, `average` and outer learning rate 1 (which is sync) on 2 replicas,
  each step of 2 accumulated micro-batches of 16 (a wrong accumulation or
  a wrong synchronisation moves the variables).
  """
  common = dict(optimizer="sgd", learning_rate=0.1, global_batch_size=32)
  start, one = _train(small_config(num_devices=1, **common))
  _, four = _train(small_config(num_devices=4, **common))
  assert max_diff(one, four) <= 1e-5
  # Training moved the variables well beyond the tolerance, so the equality
  # above is not two untouched initialisations.
  assert max_diff(one, start) > 1e-2
  local = make_trainer(small_config(
      mode="local_sgd", num_devices=2, sync_every=1, grad_accum_steps=2,
      **dict(common, global_batch_size=16)))
  local.train(STEPS // 2)
  half = variables(local)
  local.train(STEPS - STEPS // 2)
  final, summary = variables(local), local.summary()
  local.close()
  assert max_diff(final, one) <= 1e-5
  assert max_diff(final, half) > 1e-2  # It trained.
  # H=1 sends what float32 sync sends: one float32 value per weight a step.
  params = sum(v.size for v in final)
  assert summary["allreduce_bytes_per_step"] == 4 * params
  assert summary["allreduce_ratio_to_float32"] == 1.0
  assert summary["allreduce_bytes_total"] == STEPS * 4 * params


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
