"""TensorBoard output: what Summaries writes, read back from event files."""

import errno
import glob
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorflow.core.protobuf.config_pb2 import RunMetadata

from conftest import read_events
from dist_loop.core.errors import UserError
from dist_loop.runtime import summaries as summaries_lib
from dist_loop.runtime.summaries import LOGDIR, Summaries


def _hparams(events, tag):
  return plugin_data_pb2.HParamsPluginData.FromString(
      events[tag][0].metadata.plugin_data.content)


def _layout(events):
  (value,) = events["custom_scalars__config__"].values()
  return layout_pb2.Layout.FromString(value.tensor.string_val[0])


@pytest.mark.parametrize("name, run, tag", [
    ("train/loss", "train", "loss"),
    ("eval/loss", "eval", "loss"),
    ("eval/bits_per_byte", "eval", "bits_per_byte"),
    ("train/examples_per_sec", "train", "examples_per_sec"),
    ("async/staleness_mean", "train", "async/staleness_mean"),
    ("memory/peak_rss_mb", "train", "memory/peak_rss_mb"),
    ("weights/dense/kernel", "train", "weights/dense/kernel"),
])
def test_a_flat_name_routes_to_a_run_and_a_tag(name, run, tag):
  assert summaries_lib.route(name) == (run, tag)


def test_train_and_eval_runs_share_tag_names(tmp_path):
  summaries = Summaries(str(tmp_path / "demo"))
  summaries.scalars(3, {"train/loss": 0.5, "eval/loss": 0.75,
                        "eval/accuracy": 0.25, "async/staleness_max": 2.0})
  summaries.scalars(6, {"train/loss": 0.125})
  summaries.histograms(6, {"weights/w": np.arange(10.0)})
  summaries.images(6, {"pipeline/timeline": np.zeros((4, 5, 3), np.uint8)},
                   descriptions={"pipeline/timeline": "the last step"})
  summaries.close()
  events = read_events(str(tmp_path / "demo" / LOGDIR))
  assert events["train/loss"] == {3: 0.5, 6: 0.125}
  assert events["eval/loss"] == {3: 0.75}
  assert events["eval/accuracy"] == {3: 0.25}
  assert events["train/async/staleness_max"] == {3: 2.0}
  histogram = tf.make_ndarray(events["train/weights/w"][6].tensor)
  assert histogram[:, 2].sum() == 10  # Every value is in a bucket.
  image = events["train/pipeline/timeline"][6]
  assert image.tensor.string_val[:2] == [b"5", b"4"]  # Width, height, PNG.
  assert image.metadata.summary_description == "the last step"
  assert not [n for n in events if n.startswith(("train/train/", "eval/eval/",
                                                 "train/eval/"))]


def test_hparams_name_the_trial_after_the_workdir_and_declare_metrics(
    tmp_path):
  summaries = Summaries(str(tmp_path / "demo"))
  summaries.hparams({"model": "mlp", "num_devices": 2, "straggler": None,
                     "seed": 0})
  summaries.final({"final_step": 12, "examples_per_sec": 900.0,
                   "updates_per_sec": None, "wall_time_s": 3.5})
  summaries.close()
  events = read_events(str(tmp_path / "demo" / LOGDIR))
  start = _hparams(events, "_hparams_/session_start_info").session_start_info
  assert start.group_name == "demo"
  assert start.hparams["model"].string_value == "mlp"
  assert start.hparams["num_devices"].number_value == 2
  assert start.hparams["straggler"].string_value == "None"
  experiment = _hparams(events, "_hparams_/experiment").experiment
  assert [(m.name.group, m.name.tag, m.display_name)
          for m in experiment.metric_infos] == [
              ("eval", "loss", "eval loss"),
              ("eval", "accuracy", "eval accuracy"),
              ("", "final/examples_per_sec", "examples/sec"),
              ("", "final/wall_time_s", "wall time (s)")]
  shown = {h.name for h in experiment.hparam_infos if h.differs}
  assert shown == {"model", "num_devices"}  # The columns shown at first.
  # The final values, where the declared metrics point (the session's run).
  assert events["final/examples_per_sec"] == {12: 900.0}
  assert events["final/wall_time_s"] == {12: 3.5}
  assert "final/updates_per_sec" not in events


def test_the_custom_scalars_layout_has_the_charts_of_the_written_tags(
    tmp_path):
  summaries = Summaries(str(tmp_path))
  summaries.scalars(5, {"train/loss": 1.0, "eval/loss": 1.0,
                        "train/examples_per_sec": 10.0,
                        "async/staleness_mean": 0.5,
                        "async/staleness_max": 1.0,
                        "async/worker0_steps_per_sec": 3.0})
  summaries.close()
  summaries.close()  # Once per run, however often it is closed.
  layout = _layout(read_events(str(tmp_path / LOGDIR)))
  charts = {c.title: [ch.multiline.tag[0] for ch in c.chart]
            for c in layout.category}
  assert charts == {
      "train and eval": [r"^loss$"],
      "staleness": [r"^async/staleness_(mean|max)$"],
      "throughput": [r"^examples_per_sec$",
                     r"^(steps_per_sec|updates_per_sec|"
                     r"async/worker\d+_steps_per_sec)$"]}


def test_every_custom_scalars_chart_matches_what_its_title_promises():
  tags = {"loss", "accuracy", "async/staleness_mean", "async/staleness_max",
          "ps/staleness_mean", "pipeline/bubble_measured",
          "pipeline/bubble_formula", "examples_per_sec", "updates_per_sec"}
  layout = summaries_lib.custom_scalars_layout(tags)
  assert len([c for cat in layout.category for c in cat.chart]) == sum(
      len(charts) for _, charts in summaries_lib.CUSTOM_SCALARS)
  assert not summaries_lib.custom_scalars_layout({"grad_norm"}).category


def test_an_image_that_is_not_hwc_is_refused(tmp_path):
  summaries = Summaries(str(tmp_path))
  with pytest.raises(ValueError, match="HWC with 1, 3 or 4 channels"):
    summaries.images(1, {"pipeline/timeline": np.zeros((4, 5), np.uint8)})
  summaries.close()


def test_the_graph_of_one_traced_call(tmp_path):
  summaries = Summaries(str(tmp_path))
  double = tf.function(lambda x: x * 2.0, autograph=False)
  summaries.trace_begin()
  double(tf.constant(1.0))
  summaries.trace_end(step=4)
  summaries.close()
  events = read_events(str(tmp_path / LOGDIR))
  assert list(events["train/train_step"]) == [4]
  metadata = RunMetadata.FromString(
      events["train/train_step"][4].tensor.string_val[0])
  ops = {node.op for graph in metadata.function_graphs
         for node in graph.pre_optimization_graph.node}
  assert "Mul" in ops


def test_a_disabled_writer_writes_nothing(tmp_path):
  summaries = Summaries(str(tmp_path), enabled=False)
  summaries.scalars(1, {"train/loss": 1.0, "eval/loss": 1.0})
  summaries.hparams({"model": "mlp"})
  summaries.final({"final_step": 1, "examples_per_sec": 1.0,
                   "wall_time_s": 1.0})
  summaries.trace_begin()
  summaries.trace_end(1)
  summaries.profile_begin()
  summaries.profile_end()
  summaries.close()
  assert not glob.glob(os.path.join(str(tmp_path), "**", "*"),
                       recursive=True)


@pytest.mark.parametrize("error, fix", [
    (tf.errors.PermissionDeniedError(
        None, None, "/w/tb; Permission denied"), "Fix the permissions of "),
    (tf.errors.PermissionDeniedError(
        None, None, "/w/tb; Read-only file system"),
     "Use a workdir on a filesystem mounted read-write"),
    (OSError(errno.EACCES, "Permission denied"), "Fix the permissions of "),
    (OSError(errno.EROFS, "Read-only file system"),
     "Use a workdir on a filesystem mounted read-write"),
    (tf.errors.ResourceExhaustedError(
        None, None, "/w/tb; No space left on device"), "Free some space"),
])
def test_an_unwritable_logdir_names_the_fix_of_its_cause(
    tmp_path, monkeypatch, error, fix):
  """TensorFlow reports EACCES, EPERM and EROFS as PermissionDeniedError:
  not "free some space" then."""
  def fail(logdir):
    raise error
  monkeypatch.setattr(tf.summary, "create_file_writer", fail)
  with pytest.raises(UserError) as raised:
    Summaries(str(tmp_path))
  message = str(raised.value)
  assert message.startswith(
      f"cannot write TensorBoard events under {tmp_path / LOGDIR} (")
  assert f". {fix}" in message and message.endswith(
      ", then rerun the same command to resume")
  assert "\n" not in message
  if fix != "Free some space":
    assert "space" not in message
