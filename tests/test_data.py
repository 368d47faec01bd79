"""The input pipeline: disjoint shards that cover each global batch once."""

import numpy as np
import pytest
import tensorflow as tf

from dist_loop import data
from dist_loop.core.errors import UserError
from dist_loop.data import stream
from dist_loop.runtime import strategy as strategy_lib

N = 96  # Examples; a multiple of the global batch, so one epoch = 4 steps.
GLOBAL_BATCH = 24


def _per_replica_indices(num_replicas, steps, start_step=0, seed=7,
                         feed="loop"):
  """Runs a distributed input over an index dataset: the loop base's
  (`stream.replica_input` cut by `replica_batches`), or `tf.distribute`'s
  distributed dataset, which the loop base's must equal.

  Returns [step][replica] -> the example indices that replica received.
  """
  devices = [d.name for d in tf.config.list_logical_devices("CPU")]
  strategy = strategy_lib.mirrored(devices[:num_replicas])
  x = np.arange(N, dtype=np.int64)
  fn = stream.train_dataset_fn(x, x, GLOBAL_BATCH, seed, start_step)
  if feed == "loop":
    it = stream.replica_input(strategy, fn)
    batches = lambda: stream.replica_batches(strategy, next(it))  # pylint: disable=g-long-lambda
  else:
    it = iter(strategy.distribute_datasets_from_function(fn))
    batches = lambda: next(it)  # pylint: disable=g-long-lambda
  out = []
  for _ in range(steps):
    xb, _ = batches()
    out.append([t.numpy() for t in strategy.experimental_local_results(xb)])
  return out


def test_the_loops_feed_equals_tf_distribute_replica_by_replica():
  for replicas in (2, 4):
    loop = _per_replica_indices(replicas, 5)
    distributed = _per_replica_indices(replicas, 5, feed="tf.distribute")
    for a, b in zip(loop, distributed):
      assert [r.tolist() for r in a] == [r.tolist() for r in b]


def test_one_epoch_sees_every_example_exactly_once_across_replicas():
  steps = _per_replica_indices(4, N // GLOBAL_BATCH)
  seen = np.concatenate([np.concatenate(replicas) for replicas in steps])
  assert sorted(seen.tolist()) == list(range(N))
  for replicas in steps:  # Disjoint shards of the right size.
    assert all(len(r) == GLOBAL_BATCH // 4 for r in replicas)
    assert len(set(np.concatenate(replicas).tolist())) == GLOBAL_BATCH


def test_global_batches_do_not_depend_on_replica_count():
  one = _per_replica_indices(1, 6)
  four = _per_replica_indices(4, 6)
  for a, b in zip(one, four):
    assert sorted(a[0].tolist()) == sorted(np.concatenate(b).tolist())


def test_resuming_jumps_to_the_same_position():
  full = _per_replica_indices(2, 7)
  resumed = _per_replica_indices(2, 2, start_step=5)
  for a, b in zip(full[5:], resumed):
    np.testing.assert_array_equal(np.concatenate(a), np.concatenate(b))


def test_epochs_are_reshuffled_and_seeded():
  a = _per_replica_indices(1, 8, seed=1)
  b = _per_replica_indices(1, 8, seed=1)
  c = _per_replica_indices(1, 8, seed=2)
  flat = lambda s: np.concatenate([r[0] for r in s])  # pylint: disable=g-long-lambda
  np.testing.assert_array_equal(flat(a), flat(b))
  assert not np.array_equal(flat(a), flat(c))
  assert not np.array_equal(flat(a)[:N], flat(a)[N:])  # Epoch 2 != epoch 1.


@pytest.mark.parametrize("name", ["synthetic", "digits"])
def test_datasets_have_disjoint_eval_split(name):
  split = data.DATASETS.get(name)(None, 0, 28)
  assert split.train_x.shape[1:] == (28, 28, 1)
  assert split.num_classes == 10
  assert len(split.eval_y) > 0 and len(split.train_y) > len(split.eval_y)
  train_rows = {r.tobytes() for r in split.train_x}
  assert not any(r.tobytes() in train_rows for r in split.eval_x)


def test_synthetic_defaults_to_the_seed_mlp_shape():
  split = data.DATASETS.get("synthetic")(None, 0, None)
  assert split.input_shape == (10,)


def test_mnist_reads_npz_from_data_dir(tmp_path):
  rng = np.random.RandomState(0)
  np.savez(tmp_path / "mnist.npz",
           x_train=rng.randint(0, 255, (20, 28, 28), dtype=np.uint8),
           y_train=rng.randint(0, 10, 20), x_test=rng.randint(
               0, 255, (5, 28, 28), dtype=np.uint8),
           y_test=rng.randint(0, 10, 5))
  split = data.DATASETS.get("mnist")(str(tmp_path), 0, 28)
  assert split.train_x.shape == (20, 28, 28, 1)
  assert split.eval_x.shape == (5, 28, 28, 1)
  assert 0.0 <= split.train_x.min() and split.train_x.max() <= 1.0


def test_missing_mnist_names_the_expected_file(tmp_path, monkeypatch):
  monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
  with pytest.raises(UserError, match=r"mnist\.npz.*--data_dir"):
    data.DATASETS.get("mnist")(str(tmp_path / "nowhere"), 0, 28)
