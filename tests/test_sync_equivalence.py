"""1 device against 4: the same global batch must give the same variables.

This is what catches a gradient reduced twice (4x the update), not at all
(each replica on its own quarter, diverging), or a loss scaled to the
per-replica instead of the global batch.
"""

import pytest

from conftest import max_diff, trained_variables




@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 0.01)])
def test_four_devices_equal_one(small_config, tmp_path, optimizer, lr):
  def make(name, **kw):
    return small_config(workdir=str(tmp_path / name), optimizer=optimizer,
                        learning_rate=lr, **{"train_steps": 12, **kw})

  one = trained_variables(make("one", num_devices=1))
  four = trained_variables(make("four", num_devices=4))
  assert max_diff(one, four) <= 1e-5
  # Training moved the variables well beyond the tolerance, so the equality
  # above is not two untouched initialisations.
  start = trained_variables(make("start", num_devices=1, train_steps=1))
  assert max_diff(one, start) > 1e-2
