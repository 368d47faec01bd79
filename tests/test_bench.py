"""The benchmark harness runs at tiny sizes and reports sane numbers.

Speed is not asserted here (that is what tools/bench is for); the test only
checks that every in-process suite runs end to end and fills its table.
"""

import json

from tools import bench
from tools.benchmarks import mfu


def test_mfu_flop_count_matches_hand_count():
  # 2 -> 3 -> 4 with batch 5: first layer forward + dW only.
  first = 2 * 5 * 2 * 3
  second = 2 * 5 * 3 * 4
  assert mfu.train_flops_per_step(5, [2, 3, 4]) == 2 * first + 3 * second


def test_quick_suites_run_and_write_json(tmp_path):
  results = bench.run_suites(["overhead", "mfu", "data_parallel"], quick=True)
  suites = results["suites"]
  assert [r["devices"] for r in suites["overhead"]["rows"]] == [1, 2]
  for row in suites["overhead"]["rows"]:
    assert row["dist_loop ex/s"] > 0 and row["keras_fit ex/s"] > 0
  assert 0 < suites["mfu"]["rows"][0]["MFU"]
  assert len(suites["data_parallel"]["rows"]) == 7
  out = tmp_path / "bench.json"
  bench.atomic_write_json(str(out), results)
  assert json.loads(out.read_text())["suites"]["mfu"]["table"].startswith("|")
