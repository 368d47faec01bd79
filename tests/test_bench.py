"""The benchmark harness runs at tiny sizes and reports sane numbers.

Speed is not asserted here (that is what tools/bench is for); the test only
checks that every in-process suite runs end to end and fills its table.
"""

import json
import subprocess
import sys

from conftest import REPO
from tools.benchmarks import mfu


def test_mfu_flop_count_matches_hand_count():
  # 2 -> 3 -> 4 with batch 5: first layer forward + dW only.
  first = 2 * 5 * 2 * 3
  second = 2 * 5 * 3 * 4
  assert mfu.train_flops_per_step(5, [2, 3, 4]) == 2 * first + 3 * second


def test_quick_suites_run_and_write_json(tmp_path):
  # In a process of its own, as users run it: the suites leave Keras fit's
  # multi-device iterators behind, and their destruction, whenever the
  # garbage collector gets to it, stalls whatever test runs next.
  out = tmp_path / "bench.json"
  result = subprocess.run(
      [sys.executable, "-m", "tools.bench", "--quick",
       "--suite=overhead,mfu,data_parallel", f"--out={out}"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"wrote {out}" in result.stdout
  results = json.loads(out.read_text())
  suites = results["suites"]
  assert [r["devices"] for r in suites["overhead"]["rows"]] == [1, 2]
  for row in suites["overhead"]["rows"]:
    assert row["dist_loop ex/s"] > 0 and row["keras_fit ex/s"] > 0
  assert 0 < suites["mfu"]["rows"][0]["MFU"]
  assert len(suites["data_parallel"]["rows"]) == 7
  assert suites["mfu"]["table"].startswith("|")
  assert results["quick"] is True
