"""Random flag combinations: each trains or fails with one clear line.

A fixed seed picks, for each run, a value for every fuzzed flag from a mix of
valid and invalid choices. A run must either exit 0 or exit non-zero with
exactly one error line. The runs go through the entry point's flag parsing
and `main` in this process (`conftest.run_main`): an exception other than
the errors a user is shown fails the test with its traceback.
"""

import random

import pytest

from conftest import run_main

# flag -> (valid values, invalid values); None leaves the flag out. Valid
# values can still clash with each other (3 devices and a batch of 16;
# pipeline on 1 device; a sync mode's option in another mode).
CHOICES = {
    "--mode": (["sync", "sync", "async", "pipeline"], ["bogus"]),
    "--num_devices": (["1", "2", "2", "4"], ["0", "-1", "x"]),
    "--global_batch_size": (["16", "32", "24"], ["0", "7.5"]),
    "--dataset": (["synthetic", "synthetic", "digits"], ["nope"]),
    "--model": (["mlp", "mlp", "cnn"], ["nope"]),
    "--optimizer": (["sgd", "adam", "momentum"], ["nope"]),
    "--learning_rate": (["0.01", "0.001"], ["-1", "fast"]),
    "--allreduce_compression": ([None, None, "bf16"], ["int4"]),
    "--precision": (["float32", "mixed_bfloat16"], ["fp8"]),
    "--profile_steps": (["", "1,2"], ["3,1", "a,b"]),
}
INVALID_PROBABILITY = 0.06
NUM_RUNS = 10
ERROR_PREFIXES = ("error:", "FATAL Flags parsing error:")
SHORT_RUN = ["--train_steps=2", "--steps_per_loop=1", "--log_every=1",
             "--eval_every=2", "--checkpoint_every=2"]


def _combinations():
  rng = random.Random(20261129)
  for _ in range(NUM_RUNS):
    values = {flag: rng.choice(bad if rng.random() < INVALID_PROBABILITY
                               else good)
              for flag, (good, bad) in CHOICES.items()}
    yield [f"{flag}={value}" for flag, value in values.items()
           if value is not None]


COMBINATIONS = list(_combinations())


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
  """(exit code, stdout, stderr) or the exception, of every combination,
  run once whichever tests are selected."""
  results = []
  for i, args in enumerate(COMBINATIONS):
    workdir = tmp_path_factory.mktemp("fuzz") / f"run{i}"
    try:
      results.append(run_main(*args, f"--workdir={workdir}", *SHORT_RUN))
    except Exception as e:  # pylint: disable=broad-except
      results.append(e)  # Re-raised by this combination's test.
  return results


@pytest.mark.parametrize("index", range(NUM_RUNS),
                         ids=[" ".join(a) for a in COMBINATIONS])
def test_random_flags_train_or_fail_in_one_line(index, outcomes):
  outcome = outcomes[index]
  if isinstance(outcome, Exception):
    raise outcome
  code, out, err = outcome
  if code == 0:
    assert "done: step 2" in out
  else:
    errors = [line for line in err.splitlines()
              if line.startswith(ERROR_PREFIXES)]
    assert len(errors) == 1 and len(err.strip().splitlines()) == 1, err


def test_the_fuzz_covers_both_outcomes(outcomes):
  """The seed gives runs that train and runs that fail."""
  codes = [o[0] for o in outcomes if not isinstance(o, Exception)]
  assert 0 in codes and any(codes)
