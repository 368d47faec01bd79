"""Peak memory metrics: the process's peak RSS as the kernel reports it, and
one allocator peak per accelerator (CPU devices share one)."""

import sys

import pytest
import tensorflow as tf

from dist_loop.runtime import memory

MB = 1024 * 1024


def _peak_rss_mb_from_proc():
  """VmHWM of /proc/self/status (Linux): the peak resident set, in MB."""
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        value, unit = line.split()[1:3]
        assert unit == "kB"
        return int(value) / 1024
  raise AssertionError("no VmHWM in /proc/self/status")


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc")
def test_peak_rss_is_the_process_high_water_mark():
  # The mark only rises, so reads on either side bracket the metric, up to
  # the pages the kernel still counts per thread (a few MB with
  # TensorFlow's threads); a wrong unit would be off by 1024x.
  before = _peak_rss_mb_from_proc()
  out = memory.peak_memory_mb([])
  after = _peak_rss_mb_from_proc()
  assert set(out) == {"memory/peak_rss_mb"}
  assert before - 16 <= out["memory/peak_rss_mb"] <= after + 16
  assert before > 100  # TensorFlow is loaded: a unit error would show.


def test_one_entry_per_allocator_and_none_without_statistics(monkeypatch):
  asked = []
  peaks = {"CPU:0": 3 * MB, "GPU:0": 10 * MB, "GPU:1": 20 * MB}

  def get_memory_info(key):
    asked.append(key)
    if key == "GPU:1":
      raise ValueError("Allocator stats not available")
    return {"current": 0, "peak": peaks[key]}

  monkeypatch.setattr(tf.config.experimental, "get_memory_info",
                      get_memory_info)
  out = memory.peak_memory_mb(["/device:CPU:0", "/device:CPU:1",
                               "/device:CPU:3"])
  # Logical CPUs share the CPU allocator: asked once, reported as `cpu`.
  assert asked == ["CPU:0"]
  assert set(out) == {"memory/peak_rss_mb", "memory/cpu_peak_mb"}
  assert out["memory/cpu_peak_mb"] == 3.0

  asked.clear()
  out = memory.peak_memory_mb(["/job:localhost/replica:0/task:0/device:GPU:0",
                               "/device:GPU:1"])
  # Each GPU has its own; one without statistics is left out.
  assert asked == ["GPU:0", "GPU:1"]
  assert set(out) == {"memory/peak_rss_mb", "memory/gpu0_peak_mb"}
  assert out["memory/gpu0_peak_mb"] == 10.0
