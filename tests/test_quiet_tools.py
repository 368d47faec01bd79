"""tools.bench and tools.compare print their own lines only; `--verbosity`
brings TensorFlow's back, as in `experiments.train`
(`dist_loop/runtime/console.py`).

One subprocess per case, as a user runs them, without the
`TF_CPP_MIN_LOG_LEVEL` that conftest sets for this process: a user's shell
has none. tools.bench at the default verbosity is checked on the quick
suites of `test_bench.py`; tools.compare at both verbosities in
`test_compare.py`, on the runs it compares in this process.
"""

import json
import math
import re

import pytest

from conftest import NOISE, run_tool
from tools.benchmarks import data_parallel


def test_noise_pattern_matches_tensorflow_lines_only():
  noise = [
      "INFO:tensorflow:Using MirroredStrategy with devices ('/cpu:0',)",
      "I1201 16:28:11.529495 139991024311168 mirrored_strategy.py:423] Using",
      "W1201 16:32:11.289878 140598390995840 polymorphic_function.py:157] 5",
      "I0000 00:00:1796142412.212884    6492 cpu_feature_guard.cc:227] This",
      "E0000 00:00:1796142412.212884    6492 some_op.cc:1] error",
      "2026-12-01 16:28:11 oneDNN custom operations are on.",
      "WARNING: All log messages before absl::InitializeLog() is called are",
  ]
  ours = ["| run | mode | num_devices |", "plot: compare.png",
          "## mfu (35 s)", "wrote bench.json",
          "16:24:57 sync on 1 device (CPU:0)  |  mlp: 2,698 parameters"]
  assert [bool(NOISE.search(line)) for line in noise] == [True] * len(noise)
  assert [bool(NOISE.search(line)) for line in ours] == [False] * len(ours)


def _positive(value):
  return isinstance(value, float) and math.isfinite(value) and value > 0


def test_bench_shows_tensorflow_lines_when_asked(tmp_path):
  """On the data_parallel suite, whose quick run's JSON is checked here
  too (test_bench.py checks the other in-process suites', at the default
  verbosity)."""
  out = tmp_path / "bench.json"
  result = run_tool("tools.bench", "--quick", "--suite=data_parallel",
                    f"--out={out}", "--verbosity=2")
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"wrote {out}" in result.stdout
  # The strategy's INFO lines that the default verbosity hides, in absl's
  # format (`I1201 16:28:11.529495 ... mirrored_strategy.py:423] Using`).
  assert re.search(r"^I\d{4} .*\] Using MirroredStrategy", result.stderr,
                   re.MULTILINE), result.stderr[-3000:]
  assert not NOISE.search(result.stdout)

  suite = json.loads(out.read_text())["suites"]["data_parallel"]
  assert _positive(suite["seconds"])
  assert len(suite["table"].splitlines()) == len(suite["rows"]) + 2
  assert "## data_parallel (" in result.stdout
  rows = suite["rows"]
  assert [(r["devices"], r["bucket MB"], r["compression"])
          for r in rows] == list(data_parallel.QUICK_VARIANTS)
  for r in rows:
    assert _positive(r["step ms"])
    assert r["vs 1 device"] == pytest.approx(r["step ms"] / rows[0]["step ms"])
