"""tools.compare reads finished runs into one table and one plot.

Two finished runs (one device, two devices), read in this process, then
by `python -m tools.compare` as a user runs it, in a new process at the
default verbosity (its own lines only) and at --verbosity=2 (TensorFlow's
lines too): tests/test_quiet_tools.py's check of tools.bench, on tools.compare.
Bad inputs: a summary.json that a run does not write, an output path in a
missing directory, an output or an event file that is a FIFO or a
directory, a --plot not ending in .png, a --logdir that is a file, a
diverged run; and tools.bench's empty suite list.
"""

import json
import os

from absl.testing import flagsaver
import pytest
import tensorflow as tf

from conftest import NOISE, read_events, run_tool
from dist_loop import make_config, train
from tools import compare


@pytest.fixture(name="runs", scope="module")
def _runs(tmp_path_factory):
  """The configs of two finished runs of 10 steps: on 1 and on 2 devices."""
  root = tmp_path_factory.mktemp("compare")
  configs = [make_config(workdir=str(root / name), dataset="synthetic",
                         model="mlp", num_devices=n, global_batch_size=32,
                         train_steps=10, optimizer="sgd", learning_rate=0.1,
                         steps_per_loop=5, log_every=5, eval_every=10,
                         checkpoint_every=10)
             for name, n in (("one_device", 1), ("two_devices", 2))]
  for config in configs:
    train.run(config)
  return configs


def test_compare_two_runs(runs, tmp_path):
  a, b = runs
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


def test_compare_is_quiet_unless_asked(runs):
  workdirs = [config.workdir for config in runs]
  quiet = run_tool("tools.compare", *workdirs, "--plot=")
  assert quiet.returncode == 0, quiet.stderr[-3000:]
  header, rule, *rows = quiet.stdout.splitlines()
  assert header.startswith("| run | mode |") and rule.startswith("| --- |")
  assert rows[0].startswith("| one_device | sync | 1 | 10 |")
  assert rows[1].startswith("| two_devices | sync | 2 | 10 |")
  assert len(rows) == 2
  assert quiet.stderr == ""

  loud = run_tool("tools.compare", *workdirs, "--plot=", "--verbosity=2")
  assert loud.returncode == 0, loud.stderr[-3000:]
  assert loud.stdout == quiet.stdout
  # TensorFlow's import notices and the event reader's INFO lines.
  assert len(NOISE.findall(loud.stderr)) >= 3, loud.stderr[-3000:]


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


def _workdir(tmp_path, name, text):
  """A workdir whose summary.json holds `text` (no curves)."""
  workdir = tmp_path / name
  workdir.mkdir()
  (workdir / "summary.json").write_text(text)
  return str(workdir)


@pytest.mark.parametrize("text, message", [
    ("{not json", r"summary.json is not readable JSON \(Expecting"),
    ("[1, 2]", r"summary.json holds a JSON list, not an object"),
    ('{"final_step": "banana"}',
     r"summary.json: final_step is 'banana', not a number"),
    ('{"train_loss": true}', r"train_loss is True, not a number"),
])
def test_a_summary_that_a_run_does_not_write_is_one_error(tmp_path, text,
                                                          message):
  with pytest.raises(compare.RunError, match=message) as error:
    compare.load_run(_workdir(tmp_path, "run", text))
  assert "\n" not in str(error.value)
  assert str(error.value).endswith("rerun that run to rewrite it, or leave "
                                   "it out")


def test_a_diverged_run_is_marked_with_its_reason(tmp_path):
  runs = [compare.load_run(_workdir(tmp_path, name, json.dumps(
      {"mode": "sync", "final_step": 10, "diverged": diverged})))
          for name, diverged in (("ok", None), ("bad", "the loss rose"))]
  rows = compare.table(runs).splitlines()[2:]
  assert rows[0].startswith("| ok | sync |")
  assert rows[1].startswith("| bad (diverged) | sync |")
  assert compare.notes(runs) == ["bad diverged: the loss rose"]


def test_an_output_in_a_missing_directory_is_refused_before_the_table(
    runs, tmp_path):
  """As a user runs it: exit 1, one line, no table and no file."""
  result = run_tool("tools.compare", runs[0].workdir,
                    f"--plot={tmp_path / 'missing_dir' / 'x.png'}",
                    f"--json={tmp_path / 'out.json'}")
  assert result.returncode == 1
  assert result.stdout == ""
  assert result.stderr == (f"error: --plot={tmp_path}/missing_dir/x.png: the "
                           f"directory {tmp_path}/missing_dir does not exist; "
                           "create it or choose another path\n")
  assert not (tmp_path / "out.json").exists()


def test_bench_refuses_an_empty_suite_list(tmp_path):
  """`--suite=` names no suite: refused when the flags are parsed, before
  anything runs or any file is written."""
  out = tmp_path / "bench.json"
  result = run_tool("tools.bench", "--suite=", f"--out={out}", timeout=120)
  assert result.returncode != 0, result.stdout
  assert "no suite" in result.stderr and "Traceback" not in result.stderr
  assert "wrote" not in result.stdout and not out.exists()


def _outputs(tmp_path):
  """A run (summary.json only), a FIFO, a directory and a file, beside it."""
  os.mkfifo(tmp_path / "fifo")
  (tmp_path / "dir").mkdir()
  (tmp_path / "file").write_text("kept")
  return _workdir(tmp_path, "run", "{}")


@pytest.mark.parametrize("flag, value, message", [
    ("json", "fifo", "--json={t}/fifo is a FIFO (pipe); name a file"),
    ("plot", "fifo", "--plot={t}/fifo is a FIFO (pipe); name a file"),
    ("json", "dir", "--json={t}/dir is a directory; name a file"),
    ("plot", "dir", "--plot={t}/dir is a directory; name a file"),
    ("plot", "noext", "--plot={t}/noext does not end in .png; name a .png "
     "file"),
    ("json", "missing/x.json", "--json={t}/missing/x.json: the directory "
     "{t}/missing does not exist; create it or choose another path"),
    ("json", "file/x.json", "--json={t}/file/x.json: {t}/file is a file, not "
     "a directory; choose another path"),
    ("json", "run/summary.json", "--json={t}/run/summary.json is {t}/run's "
     "summary.json, which it reads; choose another path"),
    ("plot", "/proc/x.png", "--plot=/proc/x.png: the directory /proc is not "
     "writable (No such file or directory); choose another path"),
    ("logdir", "file", "--logdir={t}/file is a file, not a directory; name a "
     "directory (a missing one is made)"),
    ("logdir", "fifo", "--logdir={t}/fifo is a FIFO (pipe), not a directory; "
     "name a directory (a missing one is made)"),
    ("logdir", "file/sub", "--logdir={t}/file/sub: {t}/file is a file, not a "
     "directory; name a directory (a missing one is made)"),
    ("logdir", "/proc/x", "--logdir=/proc/x: the directory /proc is not "
     "writable (No such file or directory); choose another path"),
])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(
    tmp_path, flag, value, message):
  """Checked by kind before anything opens it (a FIFO would block); the
  file and the FIFO are left as they were, and nothing is written."""
  workdir = _outputs(tmp_path)
  before = sorted(os.listdir(tmp_path))
  outputs = {"plot": "", "json": "", "logdir": "",
             flag: os.path.join(str(tmp_path), value)}
  with flagsaver.flagsaver(**outputs):
    with pytest.raises(compare.RunError) as error:
      compare.check_outputs([workdir])
  assert str(error.value) == message.format(t=tmp_path)
  assert sorted(os.listdir(tmp_path)) == before
  assert (tmp_path / "file").read_text() == "kept"
  assert os.listdir(tmp_path / "dir") == []
  with flagsaver.flagsaver(plot=str(tmp_path / "new.png"),
                           json=str(tmp_path / "file"),
                           logdir=str(tmp_path / "tb" / "compare")):
    compare.check_outputs([workdir])  # New paths, or a file to replace.


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make, kind", [(os.mkfifo, "a FIFO (pipe)"),
                                        (os.mkdir, "a directory")])
def test_an_input_that_is_not_a_file_is_named_not_read(tmp_path, make, kind):
  """summary.json or an event file that is a FIFO (whose read would block
  forever) or a directory."""
  workdir = tmp_path / "no_summary"
  workdir.mkdir()
  make(workdir / "summary.json")
  with pytest.raises(compare.RunError) as error:
    compare.load_run(str(workdir))
  assert str(error.value) == (f"{workdir}/summary.json is {kind}, not a "
                              "run's summary; move it aside or leave that "
                              "run out")
  workdir = _workdir(tmp_path, "bad_events", "{}")
  os.makedirs(os.path.join(workdir, "tb", "train"))
  events = os.path.join(workdir, "tb", "train", "events.out.tfevents.1.x")
  make(events)
  with pytest.raises(compare.RunError) as error:
    compare.load_run(workdir)
  assert str(error.value) == (f"{events} is {kind}, not an event file; move "
                              "it aside or leave that run out")


def test_a_fifo_as_the_json_output_is_one_line_not_a_hang(tmp_path):
  """As a user runs it: exit 1, one line, no table; the FIFO is not opened
  (no reader: opening it to write would block forever)."""
  os.mkfifo(tmp_path / "out.json")
  result = run_tool("tools.compare", str(tmp_path / "run"), "--plot=",
                    f"--json={tmp_path / 'out.json'}", timeout=120)
  assert result.returncode == 1
  assert result.stdout == ""
  assert result.stderr == (f"error: --json={tmp_path}/out.json is a FIFO "
                           "(pipe); name a file\n")
