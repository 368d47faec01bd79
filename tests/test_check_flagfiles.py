"""tools/check_flagfiles.py, without training: the headers it reads, the
verdicts on a summary.json, its runs' failures and bounds, the record.

`make check-flagfiles` itself trains every flagfile and is not part of
`make test`; here every run is a fake that writes a summary.json, or a
tiny Python program.
"""

import datetime
import json
import os
import sys

import pytest

from conftest import REPO
from tools import check_flagfiles as cf

HEADER = """\
# launcher: --num_workers=2
# What it shows.
#
#   python -m tools.launch --num_workers=2 -- python -m experiments.train \\
#       --flagfile=experiments/configs/x.flags --workdir=runs/x
#
# Expect about 98%.
# promise: eval_accuracy >= 0.97 at step 600
# promise: memory_held_mb <= 3.7 at step 600
# A second command, not run:
#   python -m experiments.train --flagfile=experiments/configs/x.flags \\
#       --workdir=runs/y
--flagfile=base.flags
# promise: a comment below the header is a flag file's, not a promise
"""


def _write(tmp_path, text, name="x.flags"):
  path = tmp_path / name
  path.write_text(text, encoding="utf-8")
  return str(path)


def test_every_configs_flagfile_with_a_command_promises_its_own_run(
    monkeypatch):
  monkeypatch.chdir(REPO)
  headers = [cf.read_header(p) for p in cf.flagfiles([])]
  runnable = [h for h in headers if h.command is not None]
  assert [os.path.basename(h.path) for h in headers
          if h.command is None] == ["base.flags"]
  for h in runnable:
    assert h.promises, h.path
    assert f"--flagfile={h.path}" in h.command, h.path
    assert h.command[:3] in (["python", "-m", "experiments.train"],
                             ["python", "-m", "tools.launch"]), h.path


def test_the_header_gives_the_first_command_and_every_promise(tmp_path):
  header = cf.read_header(_write(tmp_path, HEADER))
  assert header.command == [
      "python", "-m", "tools.launch", "--num_workers=2", "--", "python", "-m",
      "experiments.train", "--flagfile=experiments/configs/x.flags",
      "--workdir=runs/x"]
  assert header.promises == [cf.Promise("eval_accuracy", ">=", 0.97, 600),
                             cf.Promise("memory_held_mb", "<=", 3.7, 600)]
  assert str(header.promises[0]) == "eval_accuracy >= 0.97 at step 600"
  # Every `python` is this interpreter; the workdir is the checker's.
  command = cf.prepared(header.command, "/tmp/w")
  assert command.count(sys.executable) == 2 and "python" not in command
  assert command[-1] == "--workdir=/tmp/w"


@pytest.mark.parametrize("text, match", [
    ("# promise: eval_accuracy > 0.9 at step 10\n", r"cannot read .*write it "
     r"as '# promise: KEY >= NUMBER at step N'"),
    ("# promise: eval_accuracy >= 0.9\n", "cannot read"),
    ("#   python -m experiments.train --workdir=runs/x\n",
     "gives a command but no '# promise"),
])
def test_a_header_it_cannot_use_is_one_error_naming_the_fix(tmp_path, text,
                                                             match):
  with pytest.raises(cf.InputError, match=match):
    cf.read_header(_write(tmp_path, text))


@pytest.mark.parametrize("summary, broken", [
    ({"final_step": 600, "eval_accuracy": 0.97}, None),
    ({"final_step": 600, "eval_accuracy": 0.9699}, "eval_accuracy = 0.9699"),
    ({"final_step": 590, "eval_accuracy": 0.99}, "ended at step 590"),
    ({"final_step": 600}, "summary.json has no number eval_accuracy"),
    ({"final_step": 600, "eval_accuracy": None}, "summary.json has no number eval_accuracy"),
    ({"final_step": 600, "eval_accuracy": True}, "summary.json has no number eval_accuracy"),
])
def test_a_promise_is_kept_only_at_its_step_on_its_side(summary, broken):
  assert cf.Promise("eval_accuracy", ">=", 0.97, 600).judge(summary) == broken


def test_an_upper_bound_is_kept_at_or_below_it():
  at_most = cf.Promise("eval_bits_per_byte", "<=", 2.85, 600)
  assert at_most.judge({"final_step": 600, "eval_bits_per_byte": 2.85}) is None
  assert at_most.judge({"final_step": 600, "eval_bits_per_byte": 2.86}) == (
      "eval_bits_per_byte = 2.86")


def _fake_runner(summary, failure=None, calls=None):
  """A runner that writes `summary` into the command's workdir."""

  def run(command, log_path, timeout_s, cwd=None):
    assert cwd is not None and os.path.isdir(cwd)  # The run's own place.
    if calls is not None:
      calls.append((command, log_path, timeout_s))
    if failure is not None:
      return failure
    if not command[-1].startswith("--workdir="):
      return None  # A setup command.
    workdir = command[-1].split("=", 1)[1]
    os.makedirs(workdir)
    if summary is not None:
      with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f)
    return None

  return run


def test_check_runs_the_command_in_a_fresh_workdir_and_judges(tmp_path):
  header = cf.read_header(_write(tmp_path, HEADER))
  root = str(tmp_path / "root")
  place = os.path.join(os.path.abspath(root), "x")
  assert cf.check(header, root, 5.0, _fake_runner(None)).broken
  os.makedirs(os.path.join(place, "checkpoints"))  # A previous run's.
  calls = []
  kept = cf.check(header, root, 5.0, _fake_runner(
      {"final_step": 600, "eval_accuracy": 0.98, "memory_held_mb": 3.6},
      calls=calls))
  assert kept.kept and kept.name == "x"
  (command, log_path, timeout_s), = calls
  assert command[-1] == f"--workdir={os.path.join(place, 'workdir')}"
  assert not os.path.exists(os.path.join(place, "checkpoints"))
  assert sorted(os.listdir(place)) == [cf.MARKER, "workdir"]
  assert log_path == os.path.join(place, "x.log") and timeout_s == 5.0
  broken = cf.check(header, root, 5.0, _fake_runner(
      {"final_step": 600, "eval_accuracy": 0.5, "memory_held_mb": 7.3}))
  assert broken.broken == [
      "eval_accuracy >= 0.97 at step 600: eval_accuracy = 0.5",
      "memory_held_mb <= 3.7 at step 600: memory_held_mb = 7.3"]
  failed = cf.check(header, root, 5.0, _fake_runner(None, "exit code 3"))
  assert failed.broken == ["exit code 3"]
  silent = cf.check(header, root, 5.0, _fake_runner(None))
  assert len(silent.broken) == 1
  assert silent.broken[0].startswith("no readable summary.json")
  lines = cf.table([kept, broken]).splitlines()
  assert len(lines) == 4 and lines[2].endswith("| kept |")
  assert "| eval_accuracy = 0.98; memory_held_mb = 3.6 |" in lines[2]
  assert "| BROKEN: eval_accuracy >= 0.97" in lines[3]


def test_a_run_that_fails_or_hangs_is_named_with_its_log(tmp_path):
  log = str(tmp_path / "run.log")
  assert cf.run_command([sys.executable, "-c", "print('ok')"], log,
                        30.0) is None
  assert cf.run_command(
      [sys.executable, "-c", "print('oops'); raise SystemExit(3)"], log,
      30.0) == f"exit code 3 (log: {log})"
  with open(log) as f:
    assert f.read() == "oops\n"
  assert cf.run_command(
      [sys.executable, "-c", "import time; time.sleep(60)"], log,
      0.5) == f"timed out after 0.5 s (log: {log})"


def test_the_record_replaces_only_the_last_results(tmp_path):
  page = _write(tmp_path, "# Title\n\nText.\n\n## Last results\n\nOld.\n",
                "page.md")
  result = cf.Result("x", [cf.Promise("eval_accuracy", ">=", 0.97, 600)], [],
                     seconds=90.0)
  when = datetime.datetime(2026, 12, 3, 12, 45)
  pending = cf.read_header(_write(tmp_path, HEADER, "y.flags"))
  cf.record(page, [result], when, "2 cores", [pending])
  with open(page) as f:
    text = f.read()
  assert text.startswith("# Title\n\nText.\n\n## Last results\n\n")
  assert "Old." not in text
  assert "on 2026-12-03 12:45 UTC, 2 cores" in text
  assert text.endswith(
      "| x | eval_accuracy >= 0.97 at step 600 | – | 1.5 | kept |\n"
      "| y | eval_accuracy >= 0.97 at step 600; memory_held_mb <= 3.7 at "
      "step 600 | – | – | not run |\n")
  with pytest.raises(cf.InputError, match="no '## Last results' heading"):
    cf.record(_write(tmp_path, "# Title\n", "bare.md"), [result], when, "")


def test_only_names_flagfiles_in_its_order(monkeypatch):
  monkeypatch.chdir(REPO)
  assert cf.flagfiles(["ps", "default"]) == [
      "experiments/configs/ps.flags", "experiments/configs/default.flags"]


def test_bad_input_is_one_line_and_exit_2(monkeypatch, capsys):
  monkeypatch.chdir(REPO)
  assert cf.main(["--only=default,nosuch"]) == 2
  err = capsys.readouterr().err
  assert err == ("error: --only names no flagfile: nosuch; choose from "
                 "experiments/configs/*.flags\n")


def test_setup_commands_run_first_in_the_runs_own_directory(tmp_path):
  """shards.flags makes its shards first: a setup command runs before the
  training command, in the same fresh directory (where the flagfile's
  relative --data_dir then finds them), and its failure is the run's."""
  path = tmp_path / "configs" / "made.flags"
  path.parent.mkdir()
  path.write_text(
      "# Make data, then train:\n"
      "#   python -m tools.make_shards --dataset=digits \\\n"
      "#       --out=runs/d\n"
      f"#   python -m experiments.train --flagfile={path} \\\n"
      "#       --workdir=runs/made\n"
      "# promise: eval_accuracy >= 0.9 at step 2\n--train_steps=2\n")
  header = cf.read_header(str(path))
  assert header.setup == [["python", "-m", "tools.make_shards",
                           "--dataset=digits", "--out=runs/d"]]
  assert header.command[:3] == ["python", "-m", "experiments.train"]
  calls = []
  root = str(tmp_path / "root")
  kept = cf.check(header, root, 5.0, _fake_runner(
      {"final_step": 2, "eval_accuracy": 0.95}, calls=calls))
  assert kept.kept
  (setup, _, _), (run, _, _) = calls
  assert setup[1:] == header.setup[0][1:] and run[1:3] == ["-m",
                                                           "experiments.train"]
  failed = cf.check(header, root, 5.0, _fake_runner(None, "exit code 2"))
  assert failed.broken == ["setup python -m tools.make_shards: exit code 2"]


def test_check_replaces_only_a_place_it_made_or_an_empty_one(tmp_path):
  header = cf.read_header(_write(tmp_path, HEADER))
  root = tmp_path / "root"
  (root / "x").mkdir(parents=True)  # Empty: used.
  summary = {"final_step": 600, "eval_accuracy": 0.98, "memory_held_mb": 3.6}
  assert cf.check(header, str(root), 5.0, _fake_runner(summary)).kept
  assert (root / "x" / cf.MARKER).is_file()
  (root / "x" / cf.MARKER).unlink()  # Now a directory someone else keeps.
  calls = []
  with pytest.raises(cf.InputError, match=r"x is not empty and was not made "
                     r"by this check \(it has no \.check_flagfiles\); move "
                     "it away, or pass another --root"):
    cf.check(header, str(root), 5.0, _fake_runner(summary, calls=calls))
  assert not calls
  assert (root / "x" / "workdir" / "summary.json").is_file()


def test_a_root_holding_others_files_is_refused_before_any_run(
    monkeypatch, capsys, tmp_path):
  """--root=runs would hold make train's runs/default: never removed."""
  monkeypatch.chdir(REPO)
  (tmp_path / "default").mkdir()
  (tmp_path / "default" / "precious.txt").write_text("x")
  (tmp_path / "ps").write_text("a file in the place")
  for name in ("default", "ps"):
    assert cf.main([f"--only={name}", f"--root={tmp_path}",
                    "--timeout_s=2"]) == 2
  out, err = capsys.readouterr()
  place = tmp_path / "default"
  assert err.splitlines() == [
      f"error: {place} is not empty and was not made by this check (it has "
      f"no {cf.MARKER}); move it away, or pass another --root",
      f"error: {tmp_path / 'ps'} exists and is not a directory; move it "
      "away, or pass another --root"]
  assert out == ""
  assert (place / "precious.txt").read_text() == "x"
  assert sorted(os.listdir(tmp_path)) == ["default", "ps"]
  assert os.listdir(place) == ["precious.txt"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, line", [
    (["--record={t}/fifo"], "error: --record={t}/fifo is not a regular file "
     "(a device, a pipe or a socket); pass a page with a '## Last results' "
     "heading"),
    (["--record={t}/dir"], "error: --record={t}/dir is a directory; pass a "
     "page with a '## Last results' heading"),
    (["--record={t}/none"], "error: --record={t}/none cannot be read (No "
     "such file or directory); pass a page with a '## Last results' heading"),
    (["--root={t}/file"], "error: --root={t}/file is not a directory; pass a "
     "directory, or a new path under one"),
    (["--root={t}/file/a/b"], "error: --root={t}/file/a/b: {t}/file is not a "
     "directory; pass a directory, or a new path under one"),
    (["--root={t}/fifo"], "error: --root={t}/fifo is not a directory; pass a "
     "directory, or a new path under one"),
    (["--timeout_s=nan"], "error: --timeout_s=nan is not a positive number "
     "of seconds; pass one such as 1800"),
    (["--timeout_s=-5"], "error: --timeout_s=-5 is not a positive number of "
     "seconds; pass one such as 1800"),
    (["--timeout_s=0"], "error: --timeout_s=0 is not a positive number of "
     "seconds; pass one such as 1800"),
    (["--timeout_s=inf"], "error: --timeout_s=inf is not a positive number "
     "of seconds; pass one such as 1800"),
])
def test_bad_flags_are_refused_in_one_line_before_anything_runs(
    monkeypatch, capsys, tmp_path, flags, line):
  monkeypatch.chdir(REPO)
  os.mkfifo(tmp_path / "fifo")
  (tmp_path / "file").write_text("x")
  (tmp_path / "dir").mkdir()
  root = [] if any(f.startswith("--root=") for f in flags) else [
      f"--root={tmp_path}/root"]
  t = str(tmp_path)
  assert cf.main(["--only=default"] + root +
                 [f.format(t=t) for f in flags]) == 2
  out, err = capsys.readouterr()
  assert err.splitlines() == [line.format(t=t)] and out == ""
  assert sorted(os.listdir(tmp_path)) == ["dir", "fifo", "file"]
  assert (tmp_path / "file").read_text() == "x"


def test_a_root_that_cannot_be_written_is_one_line(monkeypatch, capsys):
  monkeypatch.chdir(REPO)
  assert cf.main(["--only=default", "--root=/proc/no_such_process/x"]) == 2
  out, err = capsys.readouterr()
  assert out == "[check_flagfiles] default.flags ...\n"
  assert err.splitlines() == [
      "error: /proc/no_such_process/x/default cannot be made (No such file "
      "or directory); pass a --root you can write to"]
