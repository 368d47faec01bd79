"""Checkpoints: the Checkpointer's save and restore, non-chief workers, and
checkpoints written before the restructure."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO
from helpers import load_data
from dist_loop import configure
from dist_loop import train
from dist_loop.control import weights
from dist_loop.core.config import parse_flagfile
from dist_loop.core.errors import UserError
from dist_loop.parallel.modes import build_trainer
from dist_loop.runtime import checkpoint_names, checkpoints, cluster
from dist_loop.runtime import devices

V0 = os.path.join(REPO, "tests", "data", "checkpoint_v0")


def _items(value=0.0):
  return {"step": tf.Variable(0, dtype=tf.int64),
          "w": tf.Variable([value, value])}


def test_save_skips_a_step_already_saved_and_restore_takes_the_newest(
    tmp_path):
  items = _items()
  saver = checkpoints.Checkpointer(items, str(tmp_path), max_to_keep=2)
  assert saver.saved_step is None
  assert saver.restore(tf.distribute.get_strategy().scope()) is None
  for step in (2, 4):
    items["step"].assign(step)
    items["w"].assign([step, step])
    assert saver.save(step).endswith(f"ckpt-{step}")
  assert saver.save(4) is None and saver.saved_step == 4
  fresh = _items(-1.0)
  reader = checkpoints.Checkpointer(fresh, str(tmp_path), max_to_keep=2)
  assert reader.restore(tf.distribute.get_strategy().scope()).endswith(
      "ckpt-4")
  assert int(fresh["step"].numpy()) == 4
  assert fresh["w"].numpy().tolist() == [4.0, 4.0]


def test_an_optional_item_is_restored_where_a_checkpoint_holds_it(tmp_path):
  """The input's count of bad records: a checkpoint without it (older, or
  of a run without --skip_bad_records) restores the rest and leaves it;
  one with it restores it, and restores into a run without it."""
  scope = lambda: tf.distribute.get_strategy().scope()  # pylint: disable=unnecessary-lambda-assignment
  items = _items(3.0)
  checkpoints.Checkpointer(items, str(tmp_path), 3).save(3)
  count = tf.Variable(7, dtype=tf.int64)
  fresh = {**_items(-1.0), "count": count}
  with pytest.raises(UserError, match="it holds no count"):
    checkpoints.Checkpointer(fresh, str(tmp_path), 3).restore(scope())
  reader = checkpoints.Checkpointer(fresh, str(tmp_path), 3,
                                    optional=("count",))
  assert reader.restore(scope()).endswith("ckpt-3")
  assert fresh["w"].numpy().tolist() == [3.0, 3.0] and int(count.numpy()) == 7
  count.assign(5)
  reader.save(4)
  count.assign(0)
  assert reader.restore(scope()).endswith("ckpt-4") and int(count.numpy()) == 5
  plain = _items(-1.0)
  assert checkpoints.Checkpointer(plain, str(tmp_path), 3).restore(
      scope()).endswith("ckpt-4")
  assert plain["w"].numpy().tolist() == [3.0, 3.0]


def _save_steps(workdir, steps, max_to_keep=5):
  """A checkpoint of each of `steps`, whose `w` is [step, step]."""
  items = _items()
  saver = checkpoints.Checkpointer(items, str(workdir), max_to_keep)
  for step in steps:
    items["w"].assign([step, step])
    saver.save(step)


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(
    tmp_path):
  _save_steps(tmp_path, (1, 2), max_to_keep=3)
  data_file = tmp_path / "checkpoints" / "ckpt-2.data-00000-of-00001"
  data_file.write_bytes(data_file.read_bytes()[:5])
  fresh = _items(-1.0)
  path = checkpoints.Checkpointer(fresh, str(tmp_path), 3).restore(
      tf.distribute.get_strategy().scope())
  assert path.endswith("ckpt-1") and fresh["w"].numpy().tolist() == [1.0, 1.0]
  (tmp_path / "checkpoints" / "ckpt-1.index").write_bytes(b"")
  with pytest.raises(UserError, match="no readable checkpoint .*tried ckpt-2, "
                     "ckpt-1: each is truncated or missing"):
    checkpoints.Checkpointer(_items(), str(tmp_path), 3).restore(
        tf.distribute.get_strategy().scope())


@pytest.mark.parametrize("is_chief", [True, False], ids=["chief", "worker"])
def test_an_unreadable_index_is_replaced_by_the_checkpoints_names(
    tmp_path, is_chief):
  _save_steps(tmp_path, (2, 4, 10))
  (tmp_path / "checkpoints" / "checkpoint").write_bytes(b"\xff\xfe garbage")
  assert [os.path.basename(p) for p in checkpoint_names.scan_checkpoints(
      str(tmp_path / "checkpoints"))] == ["ckpt-2", "ckpt-4", "ckpt-10"]
  fresh = _items(-1.0)
  reader = checkpoints.Checkpointer(fresh, str(tmp_path), 5, is_chief,
                                    task_index=1)
  assert reader.restore(tf.distribute.get_strategy().scope()).endswith(
      "ckpt-10")
  assert fresh["w"].numpy().tolist() == [10.0, 10.0]
  assert reader.saved_step == 10  # So the same step is not saved again.


def test_an_index_naming_only_a_missing_checkpoint_falls_back_to_the_files(
    tmp_path, caplog):
  _save_steps(tmp_path, (50, 100))
  index = tmp_path / "checkpoints" / "checkpoint"
  index.write_text('model_checkpoint_path: "ckpt-999"\n'
                   'all_model_checkpoint_paths: "ckpt-999"\n')
  fresh = _items(-1.0)
  reader = checkpoints.Checkpointer(fresh, str(tmp_path), 5)
  assert reader.restore(tf.distribute.get_strategy().scope()).endswith(
      "ckpt-100")
  assert fresh["w"].numpy().tolist() == [100.0, 100.0]
  assert reader.saved_step == 100
  assert (f"None of the checkpoints the index {index} names can be read; "
          "trying the other checkpoints, newest first: ckpt-100, ckpt-50."
          in caplog.text)
  fresh["w"].assign([110.0, 110.0])
  assert reader.save(110).endswith("ckpt-110")
  assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith(
      "ckpt-110")


def _checkpoint_files(directory):
  return {p.name: p.read_bytes() for p in directory.iterdir()}


@pytest.mark.parametrize("case", ["an_item_it_lacks", "another_shape"])
def test_a_readable_checkpoint_that_does_not_fit_is_not_called_unreadable(
    tmp_path, case):
  saver = checkpoints.Checkpointer(_items(), str(tmp_path), 3)
  saver.save(1)
  saver.save(2)
  before = _checkpoint_files(tmp_path / "checkpoints")
  if case == "an_item_it_lacks":  # As local_sgd's replicas, sync's none.
    items, differs = {**_items(), "replicas": tf.Variable(1.0)}, (
        "it holds no replicas, which this run's mode and settings need")
  else:  # As another --model.
    items = {"step": tf.Variable(0, dtype=tf.int64),
             "w": tf.Variable([0.0, 0.0, 0.0])}
    differs = "has shape (3,), where it holds one of shape (2,)"
  with pytest.raises(UserError) as info:
    checkpoints.Checkpointer(items, str(tmp_path), 3).restore(
        tf.distribute.get_strategy().scope())
  message = str(info.value)
  assert message.startswith(f"the checkpoint {tmp_path}/checkpoints/ckpt-2 "
                            "is readable, but this run cannot resume from "
                            "it: ")
  assert differs in message
  assert "aside" not in message and "unreadable" not in message
  assert message.endswith("give this run a new --workdir. The checkpoints "
                          "were left as they are")
  assert _checkpoint_files(tmp_path / "checkpoints") == before


def test_resuming_as_another_mode_or_model_says_what_differs(small_config):
  # One device and one loop: what the refusals read is the checkpoint.
  cfg = small_config(num_devices=1, optimizer="adam", train_steps=2,
                     steps_per_loop=2, log_every=2, checkpoint_every=2)
  train.run(cfg)
  saved = _checkpoint_files(Path(cfg.workdir) / "checkpoints")
  changes = {
      "local_sgd": (dict(mode="local_sgd", sync_every=2),
                    "it holds no outer_optimizer, replicas, which this run's "
                    "mode and settings need"),
      "deep_mlp": (dict(model="deep_mlp"),
                   "this run's deep_mlp/dense_in/kernel has shape (10, 512), "
                   "where it holds one of shape (10, 128)"),
  }
  for change, differs in changes.values():
    other = small_config(**{**dict(num_devices=2, optimizer="adam",
                                   train_steps=6, steps_per_loop=2,
                                   log_every=2, checkpoint_every=2),
                            **change, "allow_config_change": True})
    with pytest.raises(UserError) as info:
      train.run(other)
    assert differs in str(info.value)
    assert f"(the ones in {cfg.workdir}/flags.txt)" in str(info.value)
  assert _checkpoint_files(Path(cfg.workdir) / "checkpoints") == saved


def test_a_lost_peer_is_not_taken_for_an_unreadable_checkpoint(
    tmp_path, monkeypatch):
  # A PS that died while the checkpoint was read makes every checkpoint
  # fail the same way: it is not a reason to fall back to an older one.
  saver = checkpoints.Checkpointer(_items(), str(tmp_path), 3)
  saver.save(1)
  saver.save(2)
  tried = []

  def lost(self, path, *args, **kwargs):
    del self, args, kwargs
    tried.append(path)
    raise tf.errors.UnavailableError(None, None, "Socket closed")

  monkeypatch.setattr(tf.train.Checkpoint, "restore", lost)
  with pytest.raises(tf.errors.UnavailableError):
    saver.restore(tf.distribute.get_strategy().scope())
  assert len(tried) == 1 and tried[0].endswith("ckpt-2")


def test_a_worker_writes_to_its_own_temporary_directory(tmp_path,
                                                        monkeypatch):
  def no_environment():
    raise AssertionError("checkpoints must not read TF_CONFIG")

  monkeypatch.setattr(cluster, "current", no_environment)
  chief = checkpoints.Checkpointer(_items(), str(tmp_path), 3)
  chief.save(3)
  worker = checkpoints.Checkpointer(_items(), str(tmp_path), 3,
                                    is_chief=False, task_index=2)
  assert worker.saved_step == 3  # The chief's latest, before any save.
  written = []
  real_save = tf.train.CheckpointManager.save

  def spy(self, *args, **kwargs):
    path = real_save(self, *args, **kwargs)
    written.append(path)
    return path

  monkeypatch.setattr(tf.train.CheckpointManager, "save", spy)
  worker.save(5)
  assert os.path.dirname(written[0]) == str(
      tmp_path / "checkpoints" / "workertemp_2")
  assert not (tmp_path / "checkpoints" / "workertemp_2").exists()
  assert worker.saved_step == 5
  assert worker.manager.latest_checkpoint == str(
      tmp_path / "checkpoints" / "ckpt-5")


def _v0_config(small_config, workdir):
  """The fixture's run, from its flags.txt."""
  old = parse_flagfile(open(os.path.join(V0, "flags.txt")).read())
  return small_config(
      workdir=str(workdir), dataset=old["dataset"], model=old["model"],
      mode=old["mode"], num_devices=int(old["num_devices"]),
      global_batch_size=int(old["global_batch_size"]),
      optimizer=old["optimizer"],
      learning_rate=float(old["learning_rate"]), precision=old["precision"],
      steps_per_loop=2, log_every=2, eval_every=4, checkpoint_every=4,
      train_steps=int(old["train_steps"]))


def test_a_checkpoint_from_before_the_restructure_restores(small_config,
                                                             tmp_path):
  workdir = tmp_path / "v0"
  shutil.copytree(V0, workdir)  # Restoring must never write to the repo.
  config = configure.validate(_v0_config(small_config, workdir),
                              cluster.Cluster())
  dataset = load_data(config)
  trainer = build_trainer(config, devices.configure(2, "cpu"), dataset,
                          cluster.Cluster())
  saved = tf.train.load_checkpoint(str(workdir / "checkpoints" / "ckpt-4"))
  expected_scale = saved.get_tensor("loss_scale/scale/.ATTRIBUTES/"
                                    "VARIABLE_VALUE")
  expected_good = saved.get_tensor("loss_scale/good_steps/.ATTRIBUTES/"
                                   "VARIABLE_VALUE")
  with trainer.scope():  # Away from the saved values, so a restore shows.
    trainer.loss_scale.scale.assign(3.0)
    trainer.loss_scale.good_steps.assign(expected_good + 1)
  try:
    path = checkpoints.Checkpointer(trainer.checkpoint_items(), str(workdir),
                                    3).restore(trainer.scope())
    assert path.endswith("ckpt-4")
    assert int(trainer.step.numpy()) == 4
    expected = np.load(os.path.join(V0, "expected_weights.npz"))
    weights = trainer.model.trainable_variables
    assert len(weights) == len(expected.files) == 4
    for i, variable in enumerate(weights):
      np.testing.assert_array_equal(np.asarray(variable),
                                    expected[f"arr_{i}"])
    assert float(trainer.loss_scale.scale.numpy()) == expected_scale
    assert int(trainer.loss_scale.good_steps.numpy()) == expected_good
  finally:
    trainer.close()


def test_a_run_from_before_the_restructure_is_resumed_by_train_run(
    small_config, tmp_path):
  # Its flags.txt names every mode's options: none of them is a layout
  # change for today's run, and the restored step is the last one.
  workdir = tmp_path / "v0"
  shutil.copytree(V0, workdir)
  summary = train.run(_v0_config(small_config, workdir))
  assert summary["final_step"] == 4
  assert sorted(os.listdir(workdir / "checkpoints")) == sorted(
      os.listdir(os.path.join(V0, "checkpoints")))  # Nothing new saved.
  assert np.isfinite(summary["eval_loss"])


def test_load_model_reads_the_latest_checkpoint(small_config, tmp_path):
  workdir = tmp_path / "v0"
  shutil.copytree(V0, workdir)
  model = weights.load_model(_v0_config(small_config, workdir))
  expected = np.load(os.path.join(V0, "expected_weights.npz"))
  for i, variable in enumerate(model.trainable_variables):
    np.testing.assert_array_equal(np.asarray(variable), expected[f"arr_{i}"])
  with pytest.raises(FileNotFoundError):
    weights.load_model(_v0_config(small_config, tmp_path / "empty"))
