"""Random flag combinations: each trains or fails with one clear line.

A fixed seed picks 100 flag sets: for each fuzzed flag, nothing, a valid
value, or (rarely) an invalid one; valid values still clash with each other
(3 devices and a batch of 16, pipeline on 1 device, a sync option in another
mode, --max_loss with --nonfinite=skip). A run must either exit 0 having
trained, or exit non-zero with exactly one line: absl's "FATAL Flags parsing
error" (its second line, the pointer to --helpfull, is printed by absl's
`app.run` only) or our "error:". The runs go through the entry point's flag
parsing and `main` in this process (`conftest.run_main`): an exception other
than the errors a user is shown fails the test with its traceback. One run
that trains is repeated as a new process, end to end.
"""

import random

import pytest

from conftest import run_main, run_train

# flag -> (valid arguments, invalid arguments); None leaves the flag out.
CHOICES = {
    "--mode": ([None, "sync", "sync", "async", "pipeline", "local_sgd"],
               ["bogus", ""]),
    "--num_devices": ([None, None, "1", "2", "3"], ["0", "-1", "x"]),
    "--global_batch_size": (["16", "32", "24"], ["0", "7.5"]),
    "--dataset": (["synthetic"] * 6 + ["digits"], ["nope", "x" * 5000]),
    "--model": (["mlp"] * 9 + ["cnn"], ["nope", "m\u00fcll"]),
    "--optimizer": ([None, "sgd", "adam", "momentum", "rmsprop"],
                    ["nope", ""]),
    "--learning_rate": ([None, "0.01", "1e9"], ["-1", "fast", "nan"]),
    "--allreduce_compression": ([None, None, None, "bf16"], ["int4"]),
    "--precision": ([None] * 4 + ["mixed_bfloat16"], ["fp8"]),
    "--profile_steps": ([None], ["3,1", "a,b"]),  # (Profiling is slow.)
    "--nonfinite": ([None, None, "skip", "rollback"], ["ignore"]),
    "--max_loss": ([None, None, "100", "inf"], ["-1", "lots"]),
    "--max_rollbacks": ([None, "0"], ["-2"]),
    "--checkpoint_every": ([None, "1"], ["0"]),
    "--grace_period_s": ([None, "5"], ["0"]),
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


def _id(args):
  return " ".join(a if len(a) < 40 else a[:20] + "..." for a in args)


@pytest.fixture(name="outcomes", scope="module")
def _outcomes(tmp_path_factory):
  """(exit code, stdout, stderr) or the exception, of every combination,
  run once whichever tests are selected."""
  results = []
  for i, args in enumerate(COMBINATIONS):
    workdir = tmp_path_factory.mktemp("fuzz") / f"run{i}"
    try:  # The fuzzed flags come last: they win over the short run's.
      results.append(run_main(f"--workdir={workdir}", *SHORT_RUN, *args))
    except Exception as e:  # pylint: disable=broad-except
      results.append(e)  # Re-raised by this combination's test.
  return results


def _check(code, out, err):
  if code == 0:
    assert "done: step 2" in out
  else:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIXES), err
    assert "Traceback" not in err


@pytest.mark.parametrize("index", range(NUM_RUNS),
                         ids=[_id(a) for a in COMBINATIONS])
def test_random_flags_train_or_fail_in_one_line(index, outcomes):
  outcome = outcomes[index]
  if isinstance(outcome, Exception):
    raise outcome
  _check(*outcome)


def test_the_fuzz_covers_both_outcomes(outcomes):
  """The seed gives runs that train and runs that are refused."""
  codes = [o[0] for o in outcomes if not isinstance(o, Exception)]
  assert codes.count(0) >= 8 and len(codes) - codes.count(0) >= 50


def test_a_run_that_trains_does_so_as_a_new_process(outcomes, tmp_path):
  index = next(i for i, o in enumerate(outcomes)
               if not isinstance(o, Exception) and o[0] == 0)
  result = run_train(f"--workdir={tmp_path / 'run'}", *SHORT_RUN,
                     *COMBINATIONS[index], timeout=180)
  _check(result.returncode, result.stdout,
         "" if result.returncode == 0 else result.stderr)
  assert result.returncode == 0, result.stderr[-3000:]
