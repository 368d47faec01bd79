"""Random flag combinations: each trains or fails with one clear line.

A fixed seed picks, for each run, a value for every fuzzed flag from a mix of
valid and invalid choices. A run must either exit 0 or exit non-zero with
exactly one error line and no traceback; none may hang (each has a timeout).
"""

import random

import pytest

from conftest import run_train

# flag -> (valid values, invalid values). Valid values can still clash with
# each other (3 devices and a batch of 16; pipeline on 1 device).
CHOICES = {
    "--mode": (["sync", "sync", "async", "pipeline"], ["bogus"]),
    "--num_devices": (["1", "2", "2", "4"], ["0", "-1", "x"]),
    "--global_batch_size": (["16", "32", "24"], ["0", "7.5"]),
    "--dataset": (["synthetic", "synthetic", "digits"], ["nope"]),
    "--model": (["mlp", "mlp", "cnn"], ["nope"]),
    "--optimizer": (["sgd", "adam", "momentum"], ["nope"]),
    "--learning_rate": (["0.01", "0.001"], ["-1", "fast"]),
    "--allreduce_compression": (["none", "bf16"], ["int4"]),
    "--precision": (["float32", "mixed_bfloat16"], ["fp8"]),
    "--profile_steps": (["", "1,2"], ["3,1", "a,b"]),
}
INVALID_PROBABILITY = 0.06
NUM_RUNS = 10
ERROR_PREFIXES = ("error:", "FATAL Flags parsing error:")
OUTCOMES = []


def _combinations():
  rng = random.Random(20261129)
  for _ in range(NUM_RUNS):
    yield [f"{flag}={rng.choice(bad if rng.random() < INVALID_PROBABILITY else good)}"
           for flag, (good, bad) in CHOICES.items()]


@pytest.mark.parametrize("args", list(_combinations()),
                         ids=lambda a: " ".join(a))
def test_random_flags_train_or_fail_in_one_line(args, tmp_path):
  result = run_train(*args, f"--workdir={tmp_path / 'run'}",
                     "--train_steps=2", "--steps_per_loop=1", "--log_every=1",
                     "--eval_every=2", "--checkpoint_every=2", timeout=180)
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  OUTCOMES.append(result.returncode == 0)
  if result.returncode == 0:
    assert "done: step 2" in result.stdout
  else:
    errors = [l for l in result.stderr.splitlines()
              if l.startswith(ERROR_PREFIXES)]
    assert len(errors) == 1, result.stderr[-3000:]


def test_the_fuzz_covers_both_outcomes():
  """The seed gives runs that train and runs that fail (run after the
  others: pytest keeps file order)."""
  assert len(OUTCOMES) == NUM_RUNS
  assert any(OUTCOMES) and not all(OUTCOMES)
