"""Peak memory: per accelerator from TensorFlow's allocator, and the process.

`tf.config.experimental.get_memory_info` reports the allocator's current and
peak bytes. Every GPU has its own allocator; logical CPU devices share one,
so CPU is reported once, as `cpu`. The process's peak resident set size
(`ru_maxrss`) covers everything else: Python, tf.data buffers, the runtime.
"""

import resource
import sys
from typing import Dict, Sequence

import tensorflow as tf

MB = 1024.0 * 1024.0


def peak_memory_mb(device_names: Sequence[str]) -> Dict[str, float]:
  """Flat metrics: `memory/peak_rss_mb` and `memory/<device>_peak_mb`."""
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  # Linux reports kilobytes, macOS bytes.
  unit = MB if sys.platform == "darwin" else 1024.0
  out = {"memory/peak_rss_mb": rss / unit}
  for name in device_names:
    spec = tf.DeviceSpec.from_string(name)
    if spec.device_type == "CPU":
      key, label = "CPU:0", "cpu"
    else:
      key = f"{spec.device_type}:{spec.device_index or 0}"
      label = key.lower().replace(":", "")
    if f"memory/{label}_peak_mb" in out:
      continue
    try:
      info = tf.config.experimental.get_memory_info(key)
    except (ValueError, tf.errors.OpError):
      continue  # This device's allocator keeps no statistics.
    out[f"memory/{label}_peak_mb"] = info["peak"] / MB
  return out
