"""Shared pieces of the benchmarks: side-by-side timing and tables.

The machines are shared and noisy, so a benchmark never reports a time on
its own: it times every variant in the same process, interleaved round by
round (A B C, A B C, ...), takes each variant's median, and reports ratios.
"""

import statistics
import time
from typing import Callable, Dict, List, Sequence


def interleaved_medians(variants: Dict[str, Callable[[], None]],
                        rounds: int) -> Dict[str, float]:
  """Median seconds of each callable, timed in interleaved rounds."""
  times = {name: [] for name in variants}
  for _ in range(rounds):
    for name, fn in variants.items():
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(ts) for name, ts in times.items()}


def markdown_table(rows: List[Dict], columns: Sequence[str]) -> str:
  """Rows of dicts as a markdown table; floats get 3 significant digits."""

  def cell(v):
    if isinstance(v, float):
      return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "" if v is None else str(v)

  lines = ["| " + " | ".join(columns) + " |",
           "| " + " | ".join("---" for _ in columns) + " |"]
  lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |"
            for r in rows]
  return "\n".join(lines)
