"""Messages at start that name the real cause: TensorFlow's thread-count
variables checked beside their flags, a diverged-ratio that would call a
healthy run diverged, and a multi-worker run's start line naming its
cluster. (The workdir's messages are tests/test_workdir.py's.)"""

import os
import subprocess
import sys
import types

import pytest
import tensorflow as tf

from conftest import REPO, run_main
from dist_loop.core.errors import UserError
from dist_loop.runtime import console, devices
from dist_loop.runtime.cluster import Cluster

SMALL = ["--dataset=synthetic", "--model=mlp", "--train_steps=2"]


@pytest.mark.parametrize("name, flag", devices.THREAD_VARIABLES)
@pytest.mark.parametrize("value", ["-3", "x", "1.5", "100000"])
def test_a_thread_variable_tensorflow_cannot_take_is_one_line(name, flag,
                                                              value):
  with pytest.raises(UserError) as error:
    devices.check_thread_variables({name: value})
  assert str(error.value) == (
      f"{name}={value!r} in the environment is not a thread count from 0 to "
      f"1024 (TensorFlow reads it at start); unset it, or use --{flag}=N")


def test_thread_variables_it_can_take_pass():
  for value in ("0", "1", " 8 ", "1024", ""):
    devices.check_thread_variables({name: value for name, _ in
                                    devices.THREAD_VARIABLES})


def test_a_bad_thread_variable_stops_a_new_process_in_one_line(tmp_path):
  """As a user meets it: TensorFlow would abort with a native stack (exit
  134) when its runtime starts; the flags' check comes first."""
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
         "TF_NUM_INTRAOP_THREADS": "-3"}
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", *SMALL,
       f"--workdir={tmp_path / 'run'}"], cwd=REPO, capture_output=True,
      text=True, timeout=180, env=env)
  assert result.returncode == 1, result.stderr[-2000:]
  assert result.stderr.splitlines()[0] == (
      "FATAL Flags parsing error: TF_NUM_INTRAOP_THREADS='-3' in the "
      "environment is not a thread count from 0 to 1024 (TensorFlow reads it "
      "at start); unset it, or use --intra_op_threads=N")
  assert "Traceback" not in result.stderr
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("ratio", ["1e-9", "0.5", "1"])
def test_a_diverged_ratio_of_at_most_one_is_refused_at_parse_time(ratio,
                                                                 tmp_path):
  code, out, err = run_main(*SMALL, f"--workdir={tmp_path / 'run'}",
                            f"--diverged_loss_ratio={ratio}")
  assert code == 1 and out == ""
  assert f"--diverged_loss_ratio={float(ratio):g} would call a run whose " \
         "loss did not rise diverged" in err
  assert not (tmp_path / "run").exists()


def test_the_start_line_of_a_multi_worker_run_names_its_cluster():
  config = types.SimpleNamespace(mode="sync", model="mlp", dataset="digits",
                                 train_steps=6, global_batch_size=8)
  model = types.SimpleNamespace(trainable_variables=[tf.zeros((4, 2))])
  data = types.SimpleNamespace(train_y=[0] * 10, eval_y=[0] * 2)
  devices_ = ["/job:worker/replica:0/task:1/device:CPU:0"]
  workers = Cluster({"worker": ["a:1", "b:1"]}, "worker", 1)
  assert console.banner(config, devices_, model, data, workers).startswith(
      "sync on 2 workers, this one worker:1 on 1 device (CPU:0)  |  mlp: 8 ")
  ps = Cluster({"chief": ["a:1"], "worker": ["b:1", "c:1"], "ps": ["d:1"]},
               "chief", 0)
  assert console.banner(config, devices_, model, data, ps).startswith(
      "sync on 1 chief, 2 workers, 1 ps, this one chief:0 on 1 device")
  # One process: as before.
  assert console.banner(config, devices_, model, data, Cluster()).startswith(
      "sync on 1 device (CPU:0)  |")
