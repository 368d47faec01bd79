"""tools.compare reads finished runs into one table and one plot."""

import pytest
import tensorflow as tf

from conftest import read_events
from dist_loop import train
from tools import compare


def test_compare_two_runs(small_config, tmp_path):
  a = small_config(workdir=str(tmp_path / "one_device"), train_steps=10)
  b = small_config(workdir=str(tmp_path / "two_devices"), num_devices=2,
                   train_steps=10)
  train.run(a)
  train.run(b)
  runs = [compare.load_run(a.workdir), compare.load_run(b.workdir)]
  assert [p[1] for p in runs[0]["curves"]["train/loss"]] == [5, 10]
  assert [p[1] for p in runs[1]["curves"]["eval/accuracy"]] == [10]
  text = compare.table(runs)
  header, _, *rows = text.splitlines()
  columns = [c.strip() for c in header.strip("|").split("|")]
  assert columns[:10] == ["run", *compare.BASE_COLUMNS]
  assert rows[0].startswith("| one_device | sync | 1 | 10 |")
  assert rows[1].startswith("| two_devices | sync | 2 | 10 |")
  for row in rows:  # Every run-wide column is filled in.
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(cells[:10]), row
  png = tmp_path / "compare.png"
  compare.plot(runs, str(png))
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # The same plot as a TensorBoard image: one RGB image at step 0.
  compare.write_image(runs, str(tmp_path / "compare"))
  value = read_events(str(tmp_path / "compare"))["compare/curves"][0]
  width, height, encoded = value.tensor.string_val
  assert (int(width), int(height)) == (1100, 800)
  assert tf.io.decode_png(encoded).shape == (800, 1100, 3)
  description = value.metadata.summary_description
  assert "one_device" in description and "two_devices" in description


def test_curves_of_a_workdir_from_before_the_train_and_eval_runs(tmp_path):
  """Old workdirs kept every name as a tag of WORKDIR/tb itself."""
  logdir = str(tmp_path / "tb")
  writer = tf.summary.create_file_writer(logdir)
  with writer.as_default():
    for step, loss in ((5, 2.0), (10, 1.5)):
      tf.summary.scalar("train/loss", loss, step=step)
    tf.summary.scalar("eval/accuracy", 0.5, step=10)
  writer.close()
  curves = compare.read_curves(logdir)
  assert [(p[1], p[2]) for p in curves["train/loss"]] == [(5, 2.0), (10, 1.5)]
  assert [p[1] for p in curves["eval/accuracy"]] == [10]


def test_a_directory_that_is_not_a_run_is_named(tmp_path):
  with pytest.raises(compare.RunError, match="no summary.json"):
    compare.load_run(str(tmp_path))
