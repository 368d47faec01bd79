"""TensorBoard output: what Summaries writes, read back from event files."""

import glob
import os

import numpy as np
import tensorflow as tf
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorflow.core.protobuf.config_pb2 import RunMetadata

from conftest import read_events
from dist_loop.summaries import LOGDIR, Summaries


def test_scalars_histograms_images_and_hparams(tmp_path):
  summaries = Summaries(str(tmp_path))
  summaries.scalars(3, {"train/loss": 0.5, "eval/accuracy": 0.25})
  summaries.scalars(6, {"train/loss": 0.125})
  summaries.histograms(6, {"weights/w": np.arange(10.0)})
  summaries.images(6, {"pipeline/timeline": np.zeros((4, 5, 3), np.uint8)})
  summaries.hparams({"model": "mlp", "num_devices": 2, "straggler": None})
  summaries.close()
  events = read_events(str(tmp_path / LOGDIR))
  assert events["train/loss"] == {3: 0.5, 6: 0.125}
  assert events["eval/accuracy"] == {3: 0.25}
  histogram = tf.make_ndarray(events["weights/w"][6].tensor)
  assert histogram[:, 2].sum() == 10  # Every value is in a bucket.
  image = events["pipeline/timeline"][6].tensor.string_val
  assert image[:2] == [b"5", b"4"]  # Width, height, then the PNG.
  info = plugin_data_pb2.HParamsPluginData.FromString(
      events["_hparams_/session_start_info"][0].metadata.plugin_data.content
  ).session_start_info.hparams
  assert info["model"].string_value == "mlp"
  assert info["num_devices"].number_value == 2
  assert info["straggler"].string_value == "None"


def test_the_graph_of_one_traced_call(tmp_path):
  summaries = Summaries(str(tmp_path))
  double = tf.function(lambda x: x * 2.0)
  summaries.trace_begin()
  double(tf.constant(1.0))
  summaries.trace_end(step=4)
  summaries.close()
  events = read_events(str(tmp_path / LOGDIR))
  assert list(events["train_step"]) == [4]
  metadata = RunMetadata.FromString(
      events["train_step"][4].tensor.string_val[0])
  ops = {node.op for graph in metadata.function_graphs
         for node in graph.pre_optimization_graph.node}
  assert "Mul" in ops


def test_a_disabled_writer_writes_nothing(tmp_path):
  summaries = Summaries(str(tmp_path), enabled=False)
  summaries.scalars(1, {"train/loss": 1.0})
  summaries.hparams({"model": "mlp"})
  summaries.trace_begin()
  summaries.trace_end(1)
  summaries.profile_begin()
  summaries.profile_end()
  summaries.close()
  assert not glob.glob(os.path.join(str(tmp_path), "**", "*"),
                       recursive=True)
