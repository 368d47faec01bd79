"""The comm benchmark (tools.bench --suite=comm): its comparisons with
float32, and a quick run whose bytes follow from what each variant sends:
float32 every parameter of the model in 4 bytes, DiLoCo the same once per
H steps, every ratio against the float32 row of the same run.

Speed and accuracy are not asserted: the quick run is a smoke run of the
harness on the MLP.
"""

import pytest

from dist_loop import models
from helpers import load_data
from tools import bench
from tools.benchmarks import common, comm_bench


def _row(replicas, variant, bytes_per_step, accuracy):
  return {"replicas": replicas, "variant": variant, "target": 0.95,
          "steps": 640, "bytes_per_step": bytes_per_step,
          "eval_accuracy": accuracy}


def test_rows_are_compared_with_float32_at_the_same_replica_count():
  rows = comm_bench.with_baseline([
      _row(2, "float32", 1000.0, 0.98), _row(2, "powersgd r=4", 50.0, 0.975),
      _row(4, "float32", 2000.0, 0.90), _row(4, "powersgd r=4", 400.0, 0.97),
      _row(2, "DiLoCo H=32", 1000 / 32, 0.96)])
  float32 = {r["replicas"]: r for r in rows if r["variant"] == "float32"}
  for r in rows:  # Against float32 at its own replica count.
    base = float32[r["replicas"]]
    assert r["x_fewer_bytes"] * r["bytes_per_step"] == pytest.approx(
        base["bytes_per_step"])
    assert r["points_vs_float32"] == pytest.approx(
        100 * (r["eval_accuracy"] - base["eval_accuracy"]))
  assert comm_bench.verdicts(rows) == [
      "- powersgd r=4, 2 replicas: 20.0x fewer bytes (target >= 10x), "
      "-0.5 points vs float32 (target >= -1): met",
      "- powersgd r=4, 4 replicas: 5.0x fewer bytes (target >= 10x), "
      "+7.0 points vs float32 (target >= -1): NOT met",
      "- DiLoCo H=32, 2 replicas: 32.0x fewer bytes (target >= 32x), "
      "-2.0 points vs float32 (target >= -1): NOT met"]


def test_the_suite_is_registered():
  assert bench.SUITES["comm"] == "tools.benchmarks.comm_bench"


def test_quick_run_reports_consistent_rows():
  out = comm_bench.run(quick=True)
  rows = out["rows"]
  settings = comm_bench.SETTINGS[True]
  assert [(r["replicas"], r["variant"]) for r in rows] == [
      (2, v) for v in settings["variants"]]
  by_name = {r["variant"]: r for r in rows}
  # float32 sync sends each parameter of the model (digits' MLP) every step.
  config = common.config(dataset="digits", model=settings["model"])
  parameters = models.build_for(config, load_data(config)).count_params()
  float32 = by_name["float32"]["bytes_per_step"]
  assert float32 == 4 * parameters
  # DiLoCo sends the weights, the gradient's shapes, once per 32 steps.
  assert 32 * by_name["DiLoCo H=32"]["bytes_per_step"] == float32
  assert by_name["powersgd r=1"]["bytes_per_step"] < float32 / 10
  for r in rows:
    # The trainer's own ratio agrees with the float32 run beside it.
    assert r["ratio_to_float32"] * float32 == pytest.approx(
        r["bytes_per_step"], rel=1e-12)
    assert r["x_fewer_bytes"] * r["bytes_per_step"] == pytest.approx(
        float32, rel=1e-12)
    assert r["steps"] == settings["steps"]
    assert 0 <= r["eval_accuracy"] <= 1
    assert (r["examples_per_sec_min"] <= r["examples_per_sec"]
            <= r["examples_per_sec_max"])
    if r["steps_to_target"] is not None:
      assert r["steps_to_target"] % comm_bench.CHUNK == 0
      assert r["seconds_to_target"] > 0
  lines = out["table"].splitlines()
  assert len(lines) == len(rows) + 2 + 1 + 1  # Table, blank, one verdict.
  assert lines[-1].startswith("- DiLoCo H=32, 2 replicas: 32.0x fewer bytes")
