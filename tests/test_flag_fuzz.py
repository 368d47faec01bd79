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
fails the test with its traceback. How many pass every check (`validates`)
is fixed by the seed and checked exactly; every other one is refused by the
entry point in one line. Of those that pass, the few that between them give
every valid value of every fuzzed flag (`_covering`: the fewest that do)
train, each with the exit code the seed fixes (trained, or diverged in one line); the rest are
checked as far as the checks go (training each costs seconds). The first
combination that passes every check is also run as a new process, end to
end, in float16, where it also shows that a run prints its own lines only
(one process for both checks).

Flagfiles, read by the entry point before absl parses
(`experiments.train.expand_flagfiles`): nesting next to the including file,
a byte-order mark, text that is not UTF-8, loops, and seeded random
flagfiles made of such lines, each parsed or refused in one line.
"""

import itertools
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
from dist_loop.core.errors import UserError
from dist_loop.runtime.cluster import Cluster
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


def check(code, out, err):
  if code == 0:
    assert "done: step 2" in out
  else:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIXES), err
    assert "Traceback" not in err


def validates(args):
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


def _run(index, tmp_path):
  """Combination `index` through the entry point in this process; its exit
  code, failing if it neither trains nor fails in one line (naming its
  flags)."""
  args = COMBINATIONS[index]
  try:  # The fuzzed flags come last: they win over the short run's.
    code, out, err = run_main(f"--workdir={tmp_path / f'run{index}'}",
                              *SHORT_RUN, *args)
    check(code, out, err)
  except Exception as e:  # pylint: disable=broad-except
    raise AssertionError(f"combination {index}: {' '.join(args)}") from e
  return code


def _valid():
  return [i for i, args in enumerate(COMBINATIONS) if validates(args)]


# How many combinations pass every check: the seed fixes it. A count that
# moves means validation now refuses good runs or lets bad ones through.
NUM_VALID = 15


def test_random_flags_pass_the_checks_or_are_refused_in_one_line(tmp_path):
  """Each combination that does not pass the checks is refused by the
  entry point, in one line, before it trains (the checks are the
  entry point's: no refused run gets a workdir)."""
  valid = _valid()
  assert len(valid) == NUM_VALID, valid
  for index in sorted(set(range(NUM_RUNS)) - set(valid)):
    assert _run(index, tmp_path) != 0, COMBINATIONS[index]
    assert not (tmp_path / f"run{index}").exists()


def _covering(indices):
  """Of the combinations `indices`, the fewest that between them give every
  argument any of them gives (the first such set in index order): every
  valid value of every fuzzed flag is trained at least once."""
  left = set().union(*(COMBINATIONS[i] for i in indices))
  for size in range(len(indices) + 1):
    for chosen in itertools.combinations(sorted(indices), size):
      if left <= set().union(*(COMBINATIONS[i] for i in chosen)):
        return list(chosen)
  raise AssertionError("unreachable: all of them give every argument")


# The exit code of each of them, fixed by the seed: 0 trained, 3 diverged
# (a learning rate of 1e9). A code that moves means a valid run now fails
# while running (in one line, but of the wrong kind, which `check` does not
# tell apart), or a diverging one goes unnoticed.
EXIT_CODES = {7: 0, 26: 3, 29: 3, 62: 0, 70: 0, 82: 0, 88: 0}
NUM_GROUPS = 2  # The trained ones, in two tests of a few runs each.


@pytest.mark.parametrize("group", range(NUM_GROUPS))
def test_random_flags_that_pass_the_checks_train_or_fail_in_one_line(
    group, tmp_path):
  """Those that cover every valid value (`_covering`), run through the
  entry point: each trains, or fails while running in one line, exactly as
  when the codes were written."""
  trained = _covering(_valid())
  assert trained == sorted(EXIT_CODES)
  indices = trained[group::NUM_GROUPS]
  assert {i: _run(i, tmp_path) for i in indices} == {
      i: EXIT_CODES[i] for i in indices}


# What a run of ours prints to stderr: the time, then an optional kind.
OUR_LINE = re.compile(r"^\d\d:\d\d:\d\d (warning: |error: )?\S")


def test_a_run_that_trains_does_so_as_a_new_process_with_its_own_lines(
    tmp_path):
  """A real command, in a new process: TensorFlow's start-up included, in
  float16 (oneDNN's native DT_HALF error line, on machines without
  AVX-512), with TF_CPP_MIN_LOG_LEVEL=2 in the environment (run_train's),
  which --verbosity overrides.

  The command: the first combination that passes every check, end to
  end, with --precision=mixed_float16 after it (its own precision, if
  any, is bfloat16: the native line is float16's only). One process for both
  checks: it trains, and prints its own lines only
  (tests/test_console.py checks the terminal in this process)."""
  args = next(a for a in COMBINATIONS if validates(a))
  result = run_train(f"--workdir={tmp_path / 'run'}", *SHORT_RUN, *args,
                     "--precision=mixed_float16", timeout=180)
  check(result.returncode, result.stdout,
        "" if result.returncode == 0 else result.stderr)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stderr.splitlines()
  assert all(OUR_LINE.match(line) for line in lines), result.stderr[-3000:]
  text = [line[9:] for line in lines]  # Without the time.
  # SHORT_RUN: 2 steps, each logged, evaluated and saved at the end.
  kinds = {
      "banner": r"^sync on \d devices? \(CPU:0(, CPU:\d)*\)  \|  \w+: "
                r"[\d,]+ parameters  \|  \w+: [\d,]+ train / [\d,]+ eval "
                r"examples  \|  2 steps of \d+$",
      "progress": r"^step [12]/2  loss \S+  acc \S+  \d+ ex/s  "
                  r"eta \d+:\d\d:\d\d$",
      "eval": r"^step 2  eval/loss \S+  eval/accuracy \S+$",
      "checkpoint": r"^step 2  saved checkpoint \S+ckpt-2$",
  }
  seen = [[k for k, regex in kinds.items() if re.match(regex, line)]
          for line in text]
  # Nothing else: TensorFlow's lines would pass through our format too.
  assert seen == [["banner"], ["progress"], ["progress"], ["eval"],
                  ["checkpoint"]], "\n".join(text)
  assert result.stdout.startswith("done: step 2, eval accuracy ")


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
