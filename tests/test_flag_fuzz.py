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
fails the test with its traceback. The rules: a set with an invalid value
never passes the checks (`validates`), and each one that does not pass is
refused by the entry point in one line, before it makes a workdir. Of those
that pass, the few that between them give every valid value of every
fuzzed flag (`_covering`: the fewest that do) train: each exits 0, except
that a learning rate of 1e9 must not (it diverges, exit 3, or stops at a
non-finite step, in one line); the rest are checked as far as the checks
go (training each costs seconds). The first combination that passes every
check is also run as a new process, end to end, in float16, where it also
shows that a run prints its own lines only (one process for both checks).

Every numeric option at its bounds (`test_every_numeric_option_*`): its
bound is accepted (or refused in one line by a rule that names it, such as
the step's examples), one past it is refused naming it, and a run made of
the largest accepted values trains.

Hostile flagfiles: tests/test_flagfiles.py.
"""

import itertools
import random
import re

import pytest
from absl import flags
from absl.testing import flagsaver

from conftest import run_main, run_train
from dist_loop import configure, data, models
from dist_loop.core import config as config_lib
from dist_loop.core import options as options_lib
from dist_loop.core.errors import UserError
from dist_loop.runtime.cluster import Cluster
from experiments import flags as run_flags

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
    "--grad_accum_steps": ([None, None, "2"], ["2147483647", "0"]),
    "--diverged_loss_ratio": ([None, None, "0", "1.5"], ["1e-9", "-1"]),
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
  """(arguments, whether one of them is invalid), NUM_RUNS times."""
  rng = random.Random(SEED)
  for _ in range(NUM_RUNS):
    args, invalid = [], False
    for flag, (good, bad) in CHOICES.items():
      wrong = rng.random() < INVALID_PROBABILITY
      value = rng.choice(bad if wrong else good)
      invalid |= wrong
      if _argument(flag, value) is not None:
        args.append(_argument(flag, value))
    yield args, invalid


COMBINATIONS, HAS_INVALID = (list(x) for x in zip(*_combinations()))


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


def test_random_flags_pass_the_checks_or_are_refused_in_one_line(tmp_path):
  """A set with an invalid value never passes the checks; each combination
  that does not pass them is refused by the entry point, in one line,
  before it trains (the checks are the entry point's: no refused run gets
  a workdir). The seed's sets give all three outcomes: valid, invalid, and
  valid values that clash."""
  valid = _valid()
  assert not [i for i in valid if HAS_INVALID[i]], valid
  clashes = [i for i in range(NUM_RUNS)
             if i not in valid and not HAS_INVALID[i]]
  assert len(valid) >= 5 and len(clashes) >= 5 and sum(HAS_INVALID) >= 5
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


NUM_GROUPS = 2  # The trained ones, in two tests of a few runs each.
# The one valid value that makes a run fail while it runs.
DIVERGING = "--learning_rate=1e9"


@pytest.mark.parametrize("group", range(NUM_GROUPS))
def test_random_flags_that_pass_the_checks_train_or_fail_in_one_line(
    group, tmp_path):
  """Those that cover every valid value (`_covering`), run through the
  entry point: each trains (exit 0), except that a learning rate of 1e9
  fails while running, in one line (diverged: 3; a non-finite step: 1),
  never unnoticed."""
  indices = _covering(_valid())[group::NUM_GROUPS]
  for i in indices:
    code = _run(i, tmp_path)
    if DIVERGING in COMBINATIONS[i]:
      assert code in (1, 3), COMBINATIONS[i]
    else:
      assert code == 0, COMBINATIONS[i]


def test_the_covering_runs_include_a_diverging_one():
  assert any(DIVERGING in COMBINATIONS[i] for i in _covering(_valid()))


# -- every numeric option at its bounds --


def _numeric_options():
  """(flag, spec, the component flags that make it apply) for every
  numeric option with a declared bound, run-wide or of a component."""
  for spec in options_lib.specs(config_lib.Config):
    if _bounded(spec):
      yield spec, {}
  for selector, registry, _ in configure.COMPONENTS:
    for name in registry.names():
      cls = configure.options_class(registry, name)
      for spec in options_lib.specs(cls) if cls else ():
        if _bounded(spec):
          yield spec, _fitting(selector, name)


def _bounded(spec):
  return spec.type in (int, float) and (
      spec.lower, spec.upper, spec.above) != (None, None, None)


# What a mode needs besides its defaults to be valid.
MODE_NEEDS = {"pipeline": {"num_devices": 2},
              "ps": {"cluster": Cluster({"chief": ["h:1"], "worker": ["h:2"],
                                         "ps": ["h:3"]}, "chief", 0)}}


def _fitting(selector, name):
  """{selector: name} and a model and dataset that fit it."""
  values = {selector: name, **MODE_NEEDS.get(name, {})}
  if selector == "model":
    values["dataset"] = next(d for d in data.DATASETS.names()
                             if configure.fits(name, d) and d != "text")
  elif selector == "dataset":
    values["model"] = next(m for m in models.MODELS.names()
                           if configure.fits(m, name))
  if values.get("dataset") == "text":
    values["data_file"] = "corpus.txt"
  return values


BOUNDED = [pytest.param(spec, base, id=spec.name)
           for spec, base in _numeric_options()]


def _verdict(cluster=Cluster(), **values):
  """None if these values make a valid Config, else the error's line."""
  fields = dict(workdir="/tmp/unused", dataset="synthetic", model="mlp")
  fields.update(values)
  try:
    configure.validate(configure.make_config(**fields), cluster)
  except UserError as e:
    return str(e)
  return None


@pytest.mark.parametrize("spec,base", BOUNDED)
def test_every_numeric_option_is_refused_past_its_bounds_naming_it(
    spec, base):
  assert _verdict(**base) is None  # The base alone is valid.
  for bound, past in ((spec.lower, -1), (spec.upper, 1)):
    if bound is None:
      continue
    at = spec.type(bound)
    error = _verdict(**base, **{spec.name: at})
    # At its bound: valid, or refused by a rule between flags naming it.
    assert error is None or f"--{spec.name}=" in error, error
    beyond = at + past if spec.type is int else at * (2.0 ** past) - (
        past < 0 and at == 0)
    error = _verdict(**base, **{spec.name: spec.type(beyond)})
    assert error and f"--{spec.name}" in error and "\n" not in error, (
        spec.name, beyond, error)
  if spec.above is not None:
    error = _verdict(**base, **{spec.name: spec.type(spec.above)})
    assert error and f"--{spec.name}" in error, error


def test_grad_accum_steps_is_bounded_by_the_batch_in_one_line(tmp_path):
  """The step's input holds every micro-batch: the largest accepted value
  depends on the batch, and one more is refused before a workdir exists."""
  for batch in (2, 64, 1000):
    largest = config_lib.MAX_BATCH // batch
    assert _verdict(global_batch_size=batch, grad_accum_steps=largest) is None
    error = _verdict(global_batch_size=batch, grad_accum_steps=largest + 1)
    assert f"use --grad_accum_steps={largest} or fewer" in error
  code, out, err = run_main(f"--workdir={tmp_path / 'run'}",
                            "--grad_accum_steps=2147483647")
  assert code != 0 and "Traceback" not in out + err
  check(code, out, err)
  assert not (tmp_path / "run").exists()


def test_a_run_of_the_largest_accepted_values_trains(tmp_path):
  """The upper bound of every option the loop counts with, together, and
  the largest number of micro-batches a batch of 2**13 takes. Not the
  rates, norms and factors bounded only by float32's range
  (`options.MAX_FLOAT`): a learning rate of 1e30 is accepted, and
  diverges, as it should."""
  batch = 2**13
  largest = {spec.name: spec.type(spec.upper)
             for spec, base in _numeric_options()
             if not base and spec.upper is not None
             and spec.upper != options_lib.MAX_FLOAT and spec.name not in (
                 "train_steps", "global_batch_size", "eval_batch_size",
                 "intra_op_threads", "inter_op_threads", "grad_accum_steps")}
  args = [f"--{k}={v}" for k, v in sorted(largest.items())]
  code, out, err = run_main(
      f"--workdir={tmp_path / 'run'}", "--dataset=synthetic", "--model=mlp",
      "--train_steps=1", f"--global_batch_size={batch}",
      f"--grad_accum_steps={config_lib.MAX_BATCH // batch}",
      "--optimizer=sgd", *args)
  assert code == 0, err
  assert "done: step 1" in out


# What a run of ours prints to stderr: the time, then an optional kind.
OUR_LINE = re.compile(r"^\d\d:\d\d:\d\d (warning: |error: )?\S")


def test_a_run_that_trains_does_so_as_a_new_process_with_its_own_lines(
    tmp_path):
  """A real command, in a new process: TensorFlow's start-up included, in
  float16 (oneDNN's native DT_HALF error line, on machines without
  AVX-512), with TF_CPP_MIN_LOG_LEVEL=2 in the environment (run_train's),
  which --verbosity overrides.

  The command: the first combination that passes every check (and does
  not diverge by design: `DIVERGING`), end to
  end, with --precision=mixed_float16 after it (its own precision, if
  any, is bfloat16: the native line is float16's only). One process for both
  checks: it trains, and prints its own lines only
  (tests/test_console.py checks the terminal in this process)."""
  args = next(a for a in COMBINATIONS if validates(a) and DIVERGING not in a)
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
      "xla": r"^XLA: off \(--jit_compile=auto on CPU; --jit_compile to "
             r"compile\)$",
      "progress": r"^step [12]/2  loss \S+  acc \S+  \d+ ex/s  "
                  r"eta \d+:\d\d:\d\d$",
      "eval": r"^step 2  eval/loss \S+  eval/accuracy \S+$",
      "checkpoint": r"^step ([12])  saved checkpoint \S+ckpt-\1$",
      "start-up": r"^start-up [\d.]+ s: import [\d.]+ s, .*trace [\d.]+ s",
  }
  seen = [[k for k, regex in kinds.items() if re.match(regex, line)]
          for line in text]
  # Nothing else: TensorFlow's lines would pass through our format too.
  # One start-up line (goodput's phases), once the steady step is known.
  assert sum(k == ["start-up"] for k in seen) == 1, "\n".join(text)
  seen = [k for k in seen if k != ["start-up"]]
  every_step = ["checkpoint"] if "--checkpoint_every=1" in args else []
  assert seen == [["banner"], ["xla"], ["progress"],
                  *[[k] for k in every_step],
                  ["progress"], ["eval"], ["checkpoint"]], "\n".join(text)
  assert result.stdout.startswith("done: step 2, eval accuracy ")
