"""1 device against 4: the same global batch must give the same variables.

This is what catches a gradient reduced twice (4x the update), not at all
(each replica on its own quarter, diverging), or a loss scaled to the
per-replica instead of the global batch.
"""

import numpy as np
import pytest

from dist_loop import checkpoints, train


def final_variables(config):
  """Trains `config`, then reads the variables back from its checkpoint."""
  train.run(config)
  return [np.asarray(v) for v in
          checkpoints.load_model(config).trainable_variables]


def max_diff(a, b):
  return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 0.01)])
def test_four_devices_equal_one(small_config, tmp_path, optimizer, lr):
  def make(name, **kw):
    return small_config(workdir=str(tmp_path / name), optimizer=optimizer,
                        learning_rate=lr, **{"train_steps": 12, **kw})

  one = final_variables(make("one", num_devices=1))
  four = final_variables(make("four", num_devices=4))
  assert max_diff(one, four) <= 1e-5
  # Training moved the variables well beyond the tolerance, so the equality
  # above is not two untouched initialisations.
  start = final_variables(make("start", num_devices=1, train_steps=1))
  assert max_diff(one, start) > 1e-2
