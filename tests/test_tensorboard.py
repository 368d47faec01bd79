"""The real TensorBoard server reads a finished run through its HTTP API."""

import gzip
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from dist_loop import train

SERVER_START_TIMEOUT_S = 90


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _get(url, body=None):
  data = None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(url, data=data, headers={
      "Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=10) as r:
    raw = r.read()
    if r.headers.get("Content-Encoding") == "gzip":
      raw = gzip.decompress(raw)
    return json.loads(raw)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  from dist_loop import Config  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path_factory.mktemp("tb") / "run")
  train.run(Config(workdir=workdir, dataset="synthetic", model="mlp",
                   num_devices=2, global_batch_size=32, train_steps=10,
                   steps_per_loop=5, log_every=5, eval_every=5,
                   checkpoint_every=10, histogram_every=5,
                   profile_steps="6,8"))
  return workdir


def _loaded(base):
  """Whether the server has read the run's last scalars and histograms."""
  if not _get(base + "/data/runs"):
    return False
  scalars = _get(base + "/data/plugin/scalars/tags").get("tb", {})
  histograms = _get(base + "/data/plugin/histograms/tags").get("tb", {})
  if "eval/accuracy" not in scalars or not histograms:
    return False
  last = _get(base + "/data/plugin/scalars/scalars?run=tb&tag=eval/accuracy")
  return bool(last) and last[-1][1] == 10


@pytest.fixture(scope="module")
def server(finished_run):
  port = _free_port()
  proc = subprocess.Popen(
      [sys.executable, "-m", "tensorboard.main", "--logdir", finished_run,
       "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  base = f"http://127.0.0.1:{port}"
  deadline = time.time() + SERVER_START_TIMEOUT_S
  try:
    while True:  # Wait until it serves and has read the run's events:
      try:       # it lists a run before it has read its files.
        if _loaded(base):
          break
      except OSError:
        pass
      if proc.poll() is not None or time.time() > deadline:
        proc.terminate()  # Else reading its stderr would wait for its end.
        _, err = proc.communicate(timeout=30)
        raise RuntimeError("tensorboard did not serve the run's last "
                           "eval/accuracy and its histograms in time: "
                           + err.decode()[-2000:])
      time.sleep(0.5)
    yield base
  finally:
    proc.terminate()
    proc.wait(timeout=30)


def test_scalars_are_served(server):
  runs = _get(server + "/data/runs")
  assert runs == ["tb"]
  loss = _get(server + "/data/plugin/scalars/scalars?run=tb&tag=train/loss")
  assert [step for _, step, _ in loss] == [5, 10]
  acc = _get(server + "/data/plugin/scalars/scalars?run=tb&tag=eval/accuracy")
  assert [step for _, step, _ in acc] == [5, 10]
  assert all(0.0 <= value <= 1.0 for _, _, value in acc)
  tags = _get(server + "/data/plugin/scalars/tags")["tb"]
  for tag in ("eval/loss", "train/accuracy", "train/grad_norm",
              "train/learning_rate", "train/examples_per_sec"):
    assert tag in tags


def test_hparams_list_the_run(server):
  groups = _get(server + "/data/plugin/hparams/session_groups", {
      "experimentName": "", "startIndex": 0, "sliceSize": 10,
      "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS",
                          "STATUS_FAILURE", "STATUS_RUNNING"],
      "colParams": []})["sessionGroups"]
  assert len(groups) == 1
  assert groups[0]["hparams"]["model"] == "mlp"
  assert groups[0]["hparams"]["num_devices"] == 2


def test_histograms_and_graph(server):
  tags = _get(server + "/data/plugin/histograms/tags")["tb"]
  assert any(t.startswith("weights/") for t in tags)
  assert any(t.startswith("gradients/") for t in tags)
  info = _get(server + "/data/plugin/graphs/info")
  assert info["tb"]["tags"]["train_step"]["op_graph"]


def test_profile_tab_lists_the_profiled_steps(server):
  listing = _get(server + "/data/plugins_listing")
  assert listing["profile"]["enabled"]
  runs = _get(server + "/data/plugin/profile/runs")
  assert len(runs) == 1 and runs[0].startswith("tb/")
