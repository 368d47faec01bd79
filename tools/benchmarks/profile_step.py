r"""One training step under the profiler, and its top ops by self time.

    python -m tools.benchmarks.mfu --profile_dir=DIR [--quick]

profiles one step of the MFU suite's Transformer (`mfu.py`), trained by
`SyncTrainer` on one device, without and with `--jit_compile`: what to
look at when the suite misses its target. Each profile is a TensorBoard
logdir (`DIR/transformer`, `DIR/transformer_xla`: `tensorboard
--logdir=DIR`, Profile tab), written by `tf.profiler.experimental`; the
top ops are read back from the XSpace protobuf it writes
(`plugins/profile/RUN/HOST.xplane.pb`, parsed with TensorFlow's own
`xplane_pb2`, no other dependency).

An op is an event of the trace that is a TensorFlow kernel (named
`name:Type`; its type is the key) or an XLA instruction (an event with an
`hlo_op` stat; its name without the `.N` suffix is the key, so `MatMul.4`
counts as `MatMul` and a fusion under its own name). Its self time is its
duration less the ops nested in it on the same thread. A function call
(`__inference_...`) is not an op: what it runs is. On CPU, XLA runs some
instructions asynchronously: their events time the part on the calling
thread, so the XLA table is the rougher of the two.
"""

import dataclasses
import glob
import os
import re
from typing import Callable, Dict, List

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-direct-tensorflow-import

TOP = 10


@dataclasses.dataclass(frozen=True)
class OpTime:
  """One op's total self time in a profile."""

  name: str  # The TensorFlow op type, or the XLA instruction's name.
  seconds: float
  share: float  # Of every op's self time in the profile.
  count: int  # How many times it ran.
  xla: bool


def capture(step: Callable[[], object], logdir: str) -> str:
  """Runs `step()` once under the profiler (after one untimed run, which
  traces and compiles); returns the XSpace file written under `logdir`."""
  step()
  before = set(_xplanes(logdir))
  tf.profiler.experimental.start(logdir)
  try:
    step()
  finally:
    tf.profiler.experimental.stop()
  written = sorted(set(_xplanes(logdir)) - before)
  if not written:
    raise RuntimeError(f"the profiler wrote no .xplane.pb under {logdir}")
  return written[-1]


def _xplanes(logdir: str) -> List[str]:
  return glob.glob(os.path.join(logdir, "plugins", "profile", "*",
                                "*.xplane.pb"))


def top_ops(path: str, n: int = TOP) -> List[OpTime]:
  """The `n` ops of the XSpace file `path` with the most self time."""
  space = xplane_pb2.XSpace()
  with open(path, "rb") as f:
    space.ParseFromString(f.read())
  seconds: Dict[tuple, float] = {}
  counts: Dict[tuple, int] = {}
  for plane in space.planes:
    hlo = {k for k, m in plane.stat_metadata.items() if m.name == "hlo_op"}
    for line in plane.lines:
      for key, self_ps in _self_times(plane, line, hlo):
        seconds[key] = seconds.get(key, 0.0) + self_ps * 1e-12
        counts[key] = counts.get(key, 0) + 1
  total = sum(seconds.values()) or 1.0
  ranked = sorted(seconds, key=lambda k: -seconds[k])[:n]
  return [OpTime(name, seconds[(name, xla)], seconds[(name, xla)] / total,
                 counts[(name, xla)], xla) for name, xla in ranked]


def _op_key(plane, event, hlo):
  """(name, xla) of an op event, or None for any other event."""
  meta = plane.event_metadata[event.metadata_id]
  if any(s.metadata_id in hlo for s in event.stats):
    return re.sub(r"\.\d+$", "", meta.name), True
  op_type = meta.display_name
  if (op_type and meta.name.endswith(":" + op_type)
      and not op_type.startswith("__inference")):
    return op_type, False
  return None


def _self_times(plane, line, hlo):
  """(key, self picoseconds) of each op event of `line`."""
  ops = sorted(((e.offset_ps, e.offset_ps + e.duration_ps, key)
                for e in line.events
                for key in [_op_key(plane, e, hlo)] if key),
               key=lambda t: (t[0], -t[1]))
  out, open_ops = [], []  # open_ops: [end, key, self] of enclosing ops.
  for start, end, key in ops:
    while open_ops and open_ops[-1][0] <= start:
      _, done, own = open_ops.pop()
      out.append((done, max(own, 0)))
    if open_ops:  # Not its parent's own time (as far as it overlaps).
      open_ops[-1][2] -= min(end, open_ops[-1][0]) - start
    open_ops.append([end, key, end - start])
  out += [(key, max(own, 0)) for _, key, own in open_ops]
  return out


def table(ops: List[OpTime]) -> str:
  """The ops as a markdown table."""
  lines = ["| op | kind | self ms | share of ops | count |",
           "|---|---|---|---|---|"]
  lines += [f"| {o.name} | {'XLA' if o.xla else 'TF'} | "
            f"{1e3 * o.seconds:.3f} | {o.share:.1%} | {o.count} |"
            for o in ops]
  return "\n".join(lines)
