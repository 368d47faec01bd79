"""What a run shows in TensorBoard: read from its event files, and served
by the real TensorBoard server (one test)."""

import glob
import gzip
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from tensorboard.plugins.hparams import plugin_data_pb2

from conftest import read_events
from dist_loop import make_config, train

SERVER_START_TIMEOUT_S = 90


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _get(url):
  with urllib.request.urlopen(url, timeout=10) as r:
    raw = r.read()
    if r.headers.get("Content-Encoding") == "gzip":
      raw = gzip.decompress(raw)
    return json.loads(raw)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("tb") / "run")
  train.run(make_config(workdir=workdir, dataset="synthetic", model="mlp",
                        num_devices=2, global_batch_size=32, train_steps=10,
                        steps_per_loop=5, log_every=5, eval_every=5,
                        checkpoint_every=10, histogram_every=5,
                        profile_steps="6,8"))
  return workdir


@pytest.fixture(scope="module")
def events(finished_run):
  return read_events(os.path.join(finished_run, "tb"))


def test_scalars_land_on_the_logged_steps(events):
  assert list(events["train/loss"]) == [5, 10]
  assert list(events["eval/accuracy"]) == [5, 10]
  assert all(0.0 <= v <= 1.0 for v in events["eval/accuracy"].values())
  assert events["train/learning_rate"] == pytest.approx({5: 1e-3, 10: 1e-3})
  for tag in ("eval/loss", "train/accuracy", "train/grad_norm",
              "train/examples_per_sec", "train/updates_per_sec",
              "nonfinite/skipped_steps", "memory/peak_rss_mb"):
    assert list(events[tag]) == [5, 10], tag


def test_hparams_list_the_run(events):
  info = plugin_data_pb2.HParamsPluginData.FromString(
      events["_hparams_/session_start_info"][0].metadata.plugin_data.content
  ).session_start_info.hparams
  assert info["model"].string_value == "mlp"
  assert info["num_devices"].number_value == 2
  assert "workdir" not in info


def test_histograms_and_graph(events):
  weights = [t for t in events if t.startswith("weights/")]
  gradients = [t for t in events if t.startswith("gradients/")]
  assert len(weights) == len(gradients) == 4  # Two dense layers.
  assert all(list(events[t]) == [5, 10] for t in weights + gradients)
  assert list(events["train_step"]) == [5]  # The first loop's graph.


def test_the_profile_covers_the_profiled_steps(finished_run):
  runs = glob.glob(os.path.join(finished_run, "tb", "plugins", "profile",
                                "*", "*.xplane.pb"))
  assert len(runs) == 1


def test_the_server_serves_the_run(finished_run):
  """The real server, once: it reads the run's scalars and lists it."""
  port = _free_port()
  proc = subprocess.Popen(
      [sys.executable, "-m", "tensorboard.main", "--logdir", finished_run,
       "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  base = f"http://127.0.0.1:{port}"
  url = base + "/data/plugin/scalars/scalars?run=tb&tag=eval/accuracy"
  deadline = time.time() + SERVER_START_TIMEOUT_S
  try:
    while True:  # It lists a run before it has read its files: wait for
      try:       # the last eval/accuracy.
        served = _get(url)
        if served and served[-1][1] == 10:
          break
      except OSError:
        pass
      if proc.poll() is not None or time.time() > deadline:
        proc.terminate()  # Else reading its stderr would wait for its end.
        _, err = proc.communicate(timeout=30)
        raise AssertionError("tensorboard did not serve the run's last "
                             "eval/accuracy in time: " + err.decode()[-2000:])
      time.sleep(0.5)
    assert [step for _, step, _ in served] == [5, 10]
    assert _get(base + "/data/runs") == ["tb"]
    assert _get(base + "/data/plugins_listing")["profile"]["enabled"]
  finally:
    proc.terminate()
    proc.wait(timeout=30)
