"""What a run shows in TensorBoard: its event files, then the real server.

One finished run (`train_demo`), read from its event files, then served by
one TensorBoard server on the directory that holds it: its data API, then
its Time Series and HParams pages in headless Chromium (driven by
tests/browser.py, which also makes the README's screenshot).
"""

import glob
import os

import pytest
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2

from browser import (TEXT_JS, WINDOW, Chromium, find_chromium, get_json,
                     hparams_row, open_time_series, serve,
                     train_and_eval_cards)
from conftest import read_events
from dist_loop import make_config, train
from dist_loop.runtime.summaries import LOGDIR

def train_demo(workdir):
  """A sync run on 2 devices in `workdir` (named `demo`), with histograms
  and a profile; returns its summary."""
  return train.run(make_config(
      workdir=workdir, dataset="synthetic", model="mlp", num_devices=2,
      global_batch_size=32, train_steps=10, steps_per_loop=5, log_every=5,
      eval_every=5, checkpoint_every=10, histogram_every=5,
      profile_steps="6,8"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """`train_demo` in RUNS/demo; returns (workdir, summary)."""
  workdir = str(tmp_path_factory.mktemp("runs") / "demo")
  return workdir, train_demo(workdir)


@pytest.fixture(scope="module")
def events(finished_run):
  return read_events(os.path.join(finished_run[0], LOGDIR))


def test_train_and_eval_are_two_runs_with_the_same_tags(events):
  for name in ("loss", "accuracy"):
    assert list(events[f"train/{name}"]) == [5, 10], name
    assert list(events[f"eval/{name}"]) == [5, 10], name
  assert all(0.0 <= v <= 1.0 for v in events["eval/accuracy"].values())
  assert events["train/learning_rate"] == pytest.approx({5: 1e-3, 10: 1e-3})
  for name in ("train/grad_norm", "train/examples_per_sec",
               "train/updates_per_sec", "train/nonfinite/skipped_steps",
               "train/memory/peak_rss_mb", "train/comm/bytes_per_step"):
    assert list(events[name]) == [5, 10], name
  # No tag repeats its run's name, and only the eval metrics are in eval.
  assert not [n for n in events if n.startswith(("train/train/", "eval/eval/",
                                                 "train/eval/"))]
  assert sorted(n for n in events if n.startswith("eval/")) == [
      "eval/accuracy", "eval/loss"]


def test_hparams_list_the_run_and_its_outcome(events, finished_run):
  _, summary = finished_run
  start = plugin_data_pb2.HParamsPluginData.FromString(
      events["_hparams_/session_start_info"][0].metadata.plugin_data.content
  ).session_start_info
  assert start.group_name == "demo"  # The workdir's name.
  assert start.hparams["model"].string_value == "mlp"
  assert start.hparams["num_devices"].number_value == 2
  assert "workdir" not in start.hparams
  # What the declared metrics read: the eval run's last values and
  # summary.json's throughput and wall time.
  assert events["eval/loss"][10] == pytest.approx(summary["eval_loss"])
  assert "final/examples_per_sec" in events, (
      "summary.json's examples_per_sec is not in TensorBoard: "
      "the Summary action must call summaries.final(summary)")
  assert events["final/examples_per_sec"] == {
      10: pytest.approx(summary["examples_per_sec"], rel=1e-6)}
  assert events["final/wall_time_s"] == {
      10: pytest.approx(summary["wall_time_s"], rel=1e-6)}


def test_one_custom_scalars_layout_for_the_run(events):
  (value,) = events["custom_scalars__config__"].values()
  layout = layout_pb2.Layout.FromString(value.tensor.string_val[0])
  # Sync: no staleness, no bubble.
  assert [c.title for c in layout.category] == ["train and eval",
                                                "throughput"]
  assert [c.title for c in layout.category[0].chart] == [
      "loss (train and eval)", "accuracy (train and eval)"]


def test_histograms_and_graph_in_the_train_run(events):
  weights = [t for t in events if t.startswith("train/weights/")]
  gradients = [t for t in events if t.startswith("train/gradients/")]
  assert len(weights) == len(gradients) == 4  # Two dense layers.
  assert all(list(events[t]) == [5, 10] for t in weights + gradients)
  # The first loop (one step: the divergence reference) traces the graph.
  assert list(events["train/train_step"]) == [1]


def test_the_profile_is_in_the_train_run(finished_run):
  runs = glob.glob(os.path.join(finished_run[0], LOGDIR, "train", "plugins",
                                "profile", "*", "*.xplane.pb"))
  assert len(runs) == 1


# -- the same run, served --


@pytest.fixture(scope="module")
def served_run(finished_run):
  """(base URL, summary) of RUNS/demo (`finished_run`), served on RUNS."""
  workdir, summary = finished_run
  with serve(os.path.dirname(workdir), "demo/tb/eval", "accuracy", 10) as b:
    yield b, summary


def test_the_server_names_the_runs_after_the_workdir(served_run):
  api = served_run[0] + "/data/"
  loss = get_json(api + "plugin/scalars/scalars?run=demo/tb/train&tag=loss")
  assert [step for _, step, _ in loss] == [5, 10]
  assert get_json(api + "runs") == ["demo/tb", "demo/tb/eval", "demo/tb/train"]
  layout = get_json(api + "plugin/custom_scalars/layout")
  assert [c["title"] for c in layout["category"]] == [
      "train and eval", "throughput"]
  assert get_json(api + "plugins_listing")["profile"]["enabled"]


def test_time_series_and_hparams_pages_in_chromium(served_run, tmp_path):
  if find_chromium() is None:
    pytest.skip("Chromium is not installed: Debian's package is `chromium` "
                "(apt-get install -y chromium), which .ci/run installs")
  base, summary = served_run
  with Chromium(find_chromium()) as browser:
    cards = open_time_series(browser, base, "demo")
    # Each card overlays both runs, their last values at step 10.
    assert sorted(cards) == ["accuracy", "loss"]
    for rows in cards.values():
      assert sorted((row[0], row[2]) for row in rows) == [
          ("demo/tb/eval", "10"), ("demo/tb/train", "10")], rows
    eval_accuracy = [r for r in cards["accuracy"] if r[0] == "demo/tb/eval"]
    assert float(eval_accuracy[0][1]) == pytest.approx(
        summary["eval_accuracy"], abs=1e-4)
    shot = tmp_path / "time_series.png"
    browser.screenshot(str(shot))
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(png[16:20], "big"),  # Width and height.
            int.from_bytes(png[20:24], "big")) == WINDOW

    browser.open(f"{base}/#hparams")
    row = browser.wait_for(TEXT_JS, lambda t: hparams_row(t, "demo"),
                           "the HParams row of the run")
    assert row["mode"] == "sync" and row["model"] == "mlp"
    for column, key in (("eval loss", "eval_loss"),
                        ("eval accuracy", "eval_accuracy"),
                        ("examples/sec", "examples_per_sec"),
                        ("wall time (s)", "wall_time_s")):
      assert float(row[column]) == pytest.approx(summary[key], rel=1e-4), (
          column, row)
    browser.screenshot(str(tmp_path / "hparams.png"))


def test_the_page_readers_wait_for_complete_rows():
  """What the pages' tests wait for: both charts with a row of every run,
  and an HParams row with every number filled in."""
  runs = ["demo/tb/train", "demo/tb/eval"]
  card = lambda tag, *names: {"tag": tag, "chart": True, "rows": [
      [name, "0.5", "10", "1s"] for name in names]}
  assert train_and_eval_cards([card("loss", *runs)], runs) is None
  assert train_and_eval_cards([card("loss", *runs), card("accuracy", runs[0])],
                              runs) is None
  found = train_and_eval_cards(
      [card("loss", *runs), card("accuracy", *runs), card("grad_norm")], runs)
  assert sorted(found) == ["accuracy", "loss"]
  header = ["Trial ID", "Show Metrics", "mode", "eval loss", "eval accuracy",
            "examples/sec", "wall time (s)"]
  assert hparams_row(["demo"], "demo") is None
  assert hparams_row(header + ["demo", "sync", "0.3", "0.9", "12.5"],
                     "demo") is None  # The wall time is not shown yet.
  assert hparams_row(header + ["demo", "sync", "0.3", "0.9", "12.5", "1e+01"],
                     "demo") == {"Trial ID": "demo", "mode": "sync",
                                 "eval loss": "0.3", "eval accuracy": "0.9",
                                 "examples/sec": "12.5",
                                 "wall time (s)": "1e+01"}
