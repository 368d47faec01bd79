"""The command line as written, read before absl parses it
(`experiments/flagfiles.py`).

Flagfiles: nesting next to the including file, a byte-order mark, text
that is not UTF-8, loops, files that are not regular files (a device, a
FIFO with no writer, a directory) or too large, and seeded random
flagfiles, each parsed or refused in one line. Then the flags read before
the others exist: `--verbosity` (also tests/test_console.py) and
`--user_modules`.
"""

import os
import random
import re
import subprocess
import sys

import pytest
from absl import flags
from absl.testing import flagsaver

from conftest import REPO
from dist_loop.core.errors import UserError
from experiments import flagfiles
from experiments import flags as run_flags

SEED = 20261202


def _expand(*args):
  return flagfiles.expand_flagfiles(["train", *args])[1:]


def _write(path, data):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(data.encode() if isinstance(data, str) else data)
  return str(path)


def _config(*args):
  """The Config absl makes of `args` (no flagfile expansion of ours)."""
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["train", *args])
    return run_flags.to_config()


def test_a_flagfile_reads_as_absl_reads_it(tmp_path):
  """Comments, blank lines, surrounding spaces, later flags winning: the
  same Config as absl's own reading of the file."""
  path = _write(tmp_path / "run.flags",
                "# a comment\n\n// another\n--dataset=synthetic\n"
                "  --model=mlp  \n--seed=3\n--nodeterministic\n--seed=4\n")
  args = ["--seed=1", f"--flagfile={path}", "--workdir=/tmp/unused"]
  assert _expand(*args) == ["--seed=1", "--dataset=synthetic", "--model=mlp",
                            "--seed=3", "--nodeterministic", "--seed=4",
                            "--workdir=/tmp/unused"]
  assert _config(*_expand(*args)) == _config(*args)
  assert _config(*_expand(*args)).seed == 4
  assert _expand("--flagfile", path, "--", "--flagfile=x") == _expand(
      f"--flagfile={path}") + ["--", "--flagfile=x"]
  assert _expand("--flagfile=") == []


def test_nested_flagfiles_are_found_next_to_the_file_that_names_them(
    tmp_path, monkeypatch):
  _write(tmp_path / "exp" / "base.flags", "--seed=7\n")
  _write(tmp_path / "exp" / "sub" / "run.flags",
         "--flagfile=../base.flags\n--model=mlp\n")
  outer = _write(tmp_path / "exp" / "top.flags",
                 "--flagfile=sub/run.flags\n--dataset=synthetic\n")
  (tmp_path / "elsewhere").mkdir()
  monkeypatch.chdir(tmp_path / "elsewhere")
  assert _expand(f"--flagfile={outer}") == [
      "--seed=7", "--model=mlp", "--dataset=synthetic"]


def test_a_nested_flagfile_relative_to_the_current_directory_still_works(
    tmp_path, monkeypatch):
  """absl's rule, for flagfiles written before: only when the file is not
  next to the including one."""
  _write(tmp_path / "configs" / "base.flags", "--seed=8\n")
  outer = _write(tmp_path / "mine" / "run.flags",
                 "--flagfile=configs/base.flags\n")
  monkeypatch.chdir(tmp_path)
  assert _expand(f"--flagfile={outer}") == ["--seed=8"]


def test_a_byte_order_mark_is_ignored(tmp_path):
  path = _write(tmp_path / "bom.flags",
                "\ufeff# made on Windows\r\n--seed=5\r\n--model=mlp\r\n")
  assert _expand(f"--flagfile={path}") == ["--seed=5", "--model=mlp"]
  path = _write(tmp_path / "bom2.flags", "\ufeff--seed=6\n")
  assert _expand(f"--flagfile={path}") == ["--seed=6"]


@pytest.mark.parametrize("files, message", [
    ({"run.flags": b"--seed=1\n\xff\xfe--model=mlp\n"},
     r"^--flagfile=\S*run.flags is not UTF-8 text \(byte 0xff at offset 9\); "
     r"save it as UTF-8$"),
    ({"run.flags": b"\xef\xbb\xbf--seed=1\n\xc3(\n"},  # Offsets count the BOM.
     r"is not UTF-8 text \(byte 0xc3 at offset 12\)"),
    ({"run.flags": "--flagfile=missing.flags\n"},
     r"^cannot read --flagfile=\S*missing.flags \(named in \S*run.flags\): "
     r"No such file or directory$"),
    ({"run.flags": "--flagfile=other.flags\n", "other.flags":
      "--flagfile=run.flags\n"},
     r"^--flagfile=\S*run.flags \(named in \S*other.flags\) includes "
     r"itself: \S*run.flags -> \S*other.flags -> \S*run.flags; remove the "
     r"loop$"),
    ({"run.flags": "--flagfile=.\n"}, r"^--flagfile=\S*/\. \(named in "
     r"\S*run.flags\) is a directory, not a file of flags; save the flags "
     r"to a file and name it$"),
])
def test_a_flagfile_that_cannot_be_used_is_one_error(files, message,
                                                     tmp_path):
  for name, data in files.items():
    _write(tmp_path / name, data)
  with pytest.raises(flagfiles.FlagfileError, match=message):
    _expand(f"--flagfile={tmp_path / 'run.flags'}")
  with pytest.raises(flagfiles.FlagfileError, match="needs a file name"):
    _expand("--flagfile")
  _write(tmp_path / "bare.flags", "--seed=1\n-flagfile\nother.flags\n")
  with pytest.raises(flagfiles.FlagfileError, match=r"bare.flags has a line "
                     r"-flagfile without a file name; write -flagfile=PATH$"):
    _expand(f"--flagfile={tmp_path / 'bare.flags'}")


def test_a_flagfile_that_is_not_utf8_is_one_line_from_the_command(tmp_path):
  """As a user runs it, from another directory: exit code 2, one line."""
  _write(tmp_path / "latin1.flags", "# r\u00e9glages\n--seed=1\n".encode(
      "latin-1"))
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--flagfile=latin1.flags",
       "--workdir=run"], cwd=tmp_path, capture_output=True, text=True,
      timeout=120, env={**os.environ, "PYTHONPATH": REPO})
  assert result.returncode == 2
  assert result.stderr == ("error: --flagfile=latin1.flags is not UTF-8 "
                           "text (byte 0xe9 at offset 3); save it as "
                           "UTF-8\n")
  assert not (tmp_path / "run").exists()


# Lines a random flagfile is made of; {inner} is a flagfile beside it.
FLAGFILE_LINES = [
    "--dataset=synthetic", "--model=mlp", "--global_batch_size=16",
    "--seed=3", "  --train_steps=2  ", "# comment", "// comment", "",
    "# r\u00e9glages \u2603", "--flagfile={inner}", "--flagfile=nowhere.flags",
    "--seed=-1", "--grace_period_s=inf", "oops", "--model=m\u00fcll",
    "--flagfile", "-flagfile={inner}", "--straggler=0:1e300",
]
NUM_FLAGFILES = 30


def _random_flagfiles():
  rng = random.Random(SEED)
  for _ in range(NUM_FLAGFILES):
    lines = [rng.choice(FLAGFILE_LINES) for _ in range(rng.randint(0, 6))]
    text = rng.choice(["\n", "\r\n"]).join(lines)
    data = ("\ufeff" if rng.random() < 0.3 else "") + text
    data = data.encode()
    if rng.random() < 0.15:  # Bytes that are not UTF-8.
      cut = rng.randint(0, len(data))
      data = data[:cut] + bytes([rng.choice([0xff, 0xc3, 0x80])]) + data[cut:]
    yield data


def _outcome(data, directory):
  """None if the flagfile `data` (in `directory`, read from another one)
  parses into a Config; else the one error a user is shown."""
  _write(directory / "inner.flags", "--model=mlp\n--dataset=synthetic\n")
  path = _write(directory / "run.flags",
                data.replace(b"{inner}", b"inner.flags"))
  (directory / "cwd").mkdir(exist_ok=True)
  cwd = os.getcwd()
  os.chdir(directory / "cwd")
  try:
    config = _config(*_expand(f"--flagfile={path}", "--workdir=run"))
  except (flagfiles.FlagfileError, flags.Error, UserError) as e:
    return str(e)
  finally:
    os.chdir(cwd)
  assert config.workdir == "run"
  return None


@pytest.mark.parametrize("index", range(NUM_FLAGFILES))
def test_random_flagfiles_parse_or_fail_in_one_line(index, tmp_path):
  data = list(_random_flagfiles())[index]
  error = _outcome(data, tmp_path)
  if error is not None:
    assert error.strip() and "\n" not in error, error
    assert "Unable to open flagfile" not in error, error  # absl's words.
  undecodable = re.search(r"byte 0x(..) at offset (\d+)", error or "")
  if undecodable:  # It names the byte that is in the file there.
    assert data[int(undecodable.group(2))] == int(undecodable.group(1), 16)


def test_the_random_flagfiles_cover_both_outcomes(tmp_path):
  """Some parse, some are refused; some have a BOM, some are not UTF-8."""
  files = list(_random_flagfiles())
  errors = [_outcome(data, tmp_path) for data in files]
  assert errors.count(None) >= 3 and len(errors) - errors.count(None) >= 10
  assert sum("not UTF-8" in (e or "") for e in errors) >= 2
  assert sum(f.startswith(b"\xef\xbb\xbf") for f in files) >= 5


# -- flagfiles that are not files of flags --


def _fifo(tmp_path):
  path = str(tmp_path / "flags.fifo")
  os.mkfifo(path)  # No writer: open() for reading would block forever.
  return path


NOT_FLAGFILES = {
    "dev_zero": (lambda tmp_path: "/dev/zero", "is a character device"),
    "fifo": (_fifo, r"is a FIFO \(pipe\)"),
    "directory": (lambda tmp_path: str(tmp_path), "is a directory"),
    "too_large": (lambda tmp_path: _write(
        tmp_path / "big.flags", b"# " + b"x" * flagfiles.MAX_FLAGFILE_BYTES),
                  r"has 1,048,578 bytes, more than a flagfile may have "
                  r"\(1,048,576\); is it the right file\?$"),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("case", sorted(NOT_FLAGFILES))
def test_a_flagfile_that_is_not_a_file_of_flags_is_refused_before_reading(
    case, tmp_path):
  """At once (the bound: this test's timeout), named, given directly or
  nested in another flagfile."""
  make, message = NOT_FLAGFILES[case]
  path = make(tmp_path)
  with pytest.raises(flagfiles.FlagfileError,
                     match=rf"^--flagfile={re.escape(path)} {message}"):
    _expand("--seed=1", f"--flagfile={path}")
  outer = _write(tmp_path / "outer.flags", f"--seed=1\n--flagfile={path}\n")
  with pytest.raises(flagfiles.FlagfileError, match=(
      rf"^--flagfile={re.escape(path)} \(named in {re.escape(outer)}\) "
      rf"{message}")):
    _expand(f"--flagfile={outer}")


def test_a_flagfile_at_the_bound_is_read(tmp_path):
  path = _write(tmp_path / "full.flags", b"--seed=2\n#" + b"x" * (
      flagfiles.MAX_FLAGFILE_BYTES - len(b"--seed=2\n#")))
  assert os.path.getsize(path) == flagfiles.MAX_FLAGFILE_BYTES
  assert _expand(f"--flagfile={path}") == ["--seed=2"]


@pytest.mark.timeout(120)
def test_dev_zero_as_a_flagfile_is_one_line_and_exit_2_from_the_command(
    tmp_path):
  """As a user runs it: refused before TensorFlow starts, without a
  traceback, and no workdir made."""
  fifo = _fifo(tmp_path)
  for path in ("/dev/zero", fifo):
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", f"--flagfile={path}",
         f"--workdir={tmp_path / 'run'}"], cwd=REPO, capture_output=True,
        text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: --flagfile={path} is a ")
    assert result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "run").exists()


# -- the flags read before the others exist --


def test_user_modules_are_read_from_nested_flagfiles(tmp_path):
  """The last occurrence wins, as for every flag; items are stripped."""
  _write(tmp_path / "inner.flags", "--user_modules=a.b, ./c.py\n")
  outer = _write(tmp_path / "outer.flags", "--flagfile=inner.flags\n")
  argv = flagfiles.expand_flagfiles(["train", f"--flagfile={outer}"])
  assert flagfiles.requested_user_modules(argv) == ["a.b", "./c.py"]
  assert flagfiles.requested_user_modules(
      argv + ["--user_modules=d"]) == ["d"]
  assert flagfiles.requested_user_modules(["train"]) == []
