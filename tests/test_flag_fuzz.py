"""Random flag combinations: each trains or fails with one clear line.

A fixed seed picks 100 flag sets: for each fuzzed flag, nothing, a valid
value, or (rarely) an invalid one; valid values still clash with each other
(3 devices and a batch of 16, pipeline on 1 device, a sync option in another
mode, --max_loss with --nonfinite=skip). Invalid values include the ones
past a bound that used to crash the process (a seed outside numpy's range,
an infinite grace period, 100000 threads, a straggler of 1e300). A run must
either exit 0 having trained, or exit non-zero with exactly one line:
absl's "FATAL Flags parsing error" (its second line, the pointer to
--helpfull, is printed by absl's `app.run` only) or our "error:". The runs
go through the entry point's flag parsing and `main` in this process
(`conftest.run_main`): an exception other than the errors a user is shown
fails the test with its traceback. How many train and how many are refused
is fixed by the seed and checked exactly. The first combination that passes
every check is also run as a new process, end to end.

Flagfiles, read by the entry point before absl parses
(`experiments.train.expand_flagfiles`): nesting next to the including file,
a byte-order mark, text that is not UTF-8, loops, and seeded random
flagfiles made of such lines, each parsed or refused in one line.
"""

import os
import random
import re
import subprocess
import sys

import pytest
from absl import flags
from absl.testing import flagsaver

from conftest import REPO, run_main, run_train
from dist_loop import configure
from dist_loop.cluster import Cluster
from dist_loop.errors import UserError
from experiments import flags as run_flags
from experiments import train as entry

# flag -> (valid arguments, invalid arguments); None leaves the flag out.
CHOICES = {
    "--mode": ([None, "sync", "sync", "async", "pipeline", "local_sgd"],
               ["bogus", ""]),
    "--num_devices": ([None, None, "1", "2", "3"], ["0", "-1", "x"]),
    "--global_batch_size": (["16", "32", "24"], ["0", "7.5", "1048577"]),
    "--seed": ([None, None, "0", "4294967295"],
               ["-1", "4294967296", "1.5"]),
    "--dataset": (["synthetic"] * 6 + ["digits"], ["nope", "x" * 5000]),
    "--model": (["mlp"] * 9 + ["cnn"], ["nope", "m\u00fcll"]),
    "--optimizer": ([None, "sgd", "adam", "momentum", "rmsprop"],
                    ["nope", ""]),
    "--learning_rate": ([None, "0.01", "1e9"], ["-1", "fast", "nan"]),
    "--allreduce_compression": ([None, None, None, "bf16"], ["int4"]),
    "--precision": ([None] * 4 + ["mixed_bfloat16"], ["fp8"]),
    "--profile_steps": ([None], ["3,1", "a,b"]),  # (Profiling is slow.)
    "--nonfinite": ([None, None, "skip", "rollback"], ["ignore"]),
    "--max_loss": ([None, None, "100", "inf"], ["-1", "lots", "nan"]),
    "--max_rollbacks": ([None, "0"], ["-2"]),
    "--checkpoint_every": ([None, "1"], ["0"]),
    "--grace_period_s": ([None, "5"], ["0", "inf", "1e12", "nan"]),
    "--train_steps": ([None], ["0", "2147483648"]),
    "--intra_op_threads": ([None], ["100000", "-1"]),
    "--collective_timeout_s": ([None, "30"], ["inf", "nan", "0"]),
    "--join_timeout_s": ([None], ["1e300", "-1"]),
    "--straggler": ([None, None, None, "0:1.5"],
                    ["0:1e300", "0:inf", "0:0.5"]),
    "--allow_config_change": ([None, "--allow_config_change"], ["--allow"]),
}
INVALID_PROBABILITY = 0.06
NUM_RUNS = 100
SEED = 20261201
ERROR_PREFIXES = ("error:", "FATAL Flags parsing error:")
SHORT_RUN = ["--train_steps=2", "--steps_per_loop=1", "--log_every=1",
             "--eval_every=2", "--checkpoint_every=2"]


def _argument(flag, value):
  if value is None or value.startswith("--"):
    return value  # Left out, or a whole argument (a bool flag).
  return f"{flag}={value}"


def _combinations():
  rng = random.Random(SEED)
  for _ in range(NUM_RUNS):
    args = []
    for flag, (good, bad) in CHOICES.items():
      value = rng.choice(bad if rng.random() < INVALID_PROBABILITY else good)
      if _argument(flag, value) is not None:
        args.append(_argument(flag, value))
    yield args


COMBINATIONS = list(_combinations())


# The combinations run in two groups (the even and the odd ones), each in
# one test: a group is a few runs that train and many refusals, the size of
# one test.
NUM_GROUPS = 2


def _check(code, out, err):
  if code == 0:
    assert "done: step 2" in out
  else:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIXES), err
    assert "Traceback" not in err


def _run_group(group, tmp_path):
  """Runs the group's combinations in this process; returns their exit
  codes, failing on the first that neither trains nor fails in one line
  (naming its flags)."""
  codes = []
  for index in range(group, NUM_RUNS, NUM_GROUPS):
    args = COMBINATIONS[index]
    workdir = tmp_path / f"run{index}"
    try:  # The fuzzed flags come last: they win over the short run's.
      code, out, err = run_main(f"--workdir={workdir}", *SHORT_RUN, *args)
      _check(code, out, err)
    except Exception as e:  # pylint: disable=broad-except
      raise AssertionError(f"combination {index}: {' '.join(args)}") from e
    codes.append(code)
  return codes


# How many combinations of each group train: the seed fixes them. A count
# that moves means validation now refuses good runs or lets bad ones through
# (a bad run that gets through fails in one line while running: a refusal,
# but of the wrong kind, which `_check` does not tell apart from absl's).
TRAINS = {0: 7, 1: 4}


@pytest.mark.parametrize("group", range(NUM_GROUPS))
def test_random_flags_train_or_fail_in_one_line(group, tmp_path):
  """The seed gives runs that train and runs that are refused, in each
  group: exactly as many of each as when the counts were written."""
  codes = _run_group(group, tmp_path)
  trained = codes.count(0)
  assert (trained, len(codes) - trained) == (
      TRAINS[group], NUM_RUNS // NUM_GROUPS - TRAINS[group]), codes


def _validates(args):
  """Whether `args` pass flag parsing and every check of the run's config
  (without training)."""
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    try:
      flags.FLAGS(["train", "--workdir=/tmp/unused", *SHORT_RUN, *args])
      configure.validate(run_flags.to_config(), Cluster())
    except (flags.Error, UserError):
      return False
  return True


def test_a_run_that_trains_does_so_as_a_new_process(tmp_path):
  """The first combination that passes every check (one the groups above
  train in this process), run as a new process, end to end."""
  args = next(a for a in COMBINATIONS if _validates(a))
  result = run_train(f"--workdir={tmp_path / 'run'}", *SHORT_RUN, *args,
                     timeout=180)
  _check(result.returncode, result.stdout,
         "" if result.returncode == 0 else result.stderr)
  assert result.returncode == 0, result.stderr[-3000:]


# -- flagfiles --


def _expand(*args):
  return entry.expand_flagfiles(["train", *args])[1:]


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
    ({"run.flags": "--flagfile=.\n"}, r"^cannot read --flagfile=\S*/\. "
     r"\(named in \S*run.flags\): Is a directory$"),
])
def test_a_flagfile_that_cannot_be_used_is_one_error(files, message,
                                                     tmp_path):
  for name, data in files.items():
    _write(tmp_path / name, data)
  with pytest.raises(entry.FlagfileError, match=message):
    _expand(f"--flagfile={tmp_path / 'run.flags'}")
  with pytest.raises(entry.FlagfileError, match="needs a file name"):
    _expand("--flagfile")
  _write(tmp_path / "bare.flags", "--seed=1\n-flagfile\nother.flags\n")
  with pytest.raises(entry.FlagfileError, match=r"bare.flags has a line "
                     r"-flagfile without a file name; write -flagfile=PATH$"):
    _expand(f"--flagfile={tmp_path / 'bare.flags'}")


def test_a_flagfile_that_is_not_utf8_is_one_line_from_the_command(tmp_path):
  """As a user runs it, from another directory: exit code 1, one line."""
  _write(tmp_path / "latin1.flags", "# r\u00e9glages\n--seed=1\n".encode(
      "latin-1"))
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--flagfile=latin1.flags",
       "--workdir=run"], cwd=tmp_path, capture_output=True, text=True,
      timeout=120, env={**os.environ, "PYTHONPATH": REPO})
  assert result.returncode == 1
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
  rng = random.Random(SEED + 1)
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
  except (entry.FlagfileError, flags.Error, UserError) as e:
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
