"""Choosing devices: the names `configure` returns, and each refusal naming
its fix. conftest started TensorFlow with 4 logical CPU devices, so this
process shows the "already started" cases."""

import pytest
import tensorflow as tf

from conftest import NUM_TEST_DEVICES
from dist_loop.core.errors import UserError
from dist_loop.runtime import devices


def test_names_are_the_first_n_logical_cpus_in_order():
  for n in range(1, NUM_TEST_DEVICES + 1):
    assert devices.configure(n, "cpu") == [
        f"/device:CPU:{i}" for i in range(n)]
  # "auto" on a machine without GPUs is the CPU.
  if not tf.config.list_physical_devices("GPU"):
    assert devices.resolve_device_type("auto") == "cpu"
    assert devices.configure(2, "auto") == ["/device:CPU:0", "/device:CPU:1"]
  assert devices.resolve_device_type("gpu") == "gpu"


def test_more_devices_than_tensorflow_started_with_is_refused():
  with pytest.raises(UserError, match=(
      f"--num_devices={NUM_TEST_DEVICES + 1} but TensorFlow already started "
      f"in this process with {NUM_TEST_DEVICES} logical CPU device")):
    devices.configure(NUM_TEST_DEVICES + 1, "cpu")


def test_more_logical_cpus_than_useful_is_refused_with_the_limit():
  limit = devices.max_logical_cpus()
  assert limit >= 8
  with pytest.raises(UserError,
                     match=f"use --num_devices={limit} or fewer"):
    devices.configure(limit + 1, "cpu")


def test_missing_gpus_are_refused_naming_the_fix():
  gpus = len(tf.config.list_physical_devices("GPU"))
  with pytest.raises(UserError, match=(
      rf"--num_devices={gpus + 1} but this machine has {gpus} GPU\(s\); "
      "lower --num_devices or use --device_type=cpu")):
    devices.configure(gpus + 1, "gpu")


def test_thread_counts_once_tensorflow_runs():
  """The current counts are accepted; others need a new process."""
  intra = tf.config.threading.get_intra_op_parallelism_threads()
  inter = tf.config.threading.get_inter_op_parallelism_threads()
  assert devices.configure(1, "cpu", intra_op_threads=intra,
                           inter_op_threads=inter) == ["/device:CPU:0"]
  with pytest.raises(UserError, match="run in a new process"):
    devices.configure(1, "cpu", intra_op_threads=intra + 3)
  assert tf.config.threading.get_intra_op_parallelism_threads() == intra
