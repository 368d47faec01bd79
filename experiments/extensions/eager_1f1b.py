"""Worked example: a new pipeline schedule, as one file.

"Eager 1F1B" warms up with one more forward than 1F1B on every stage but the
last (K-k forwards on stage k, not K-k-1), then alternates one forward and
one backward, then drains. Each stage keeps one more micro-batch of
activations alive than 1F1B (at most K-k+1), and in exchange a stage always
has a forward ready when the backward it waits for is late, which hides
imbalance between stages. The executor needs nothing new: a schedule is data,
a per-stage list of actions. Select it with `--pipeline_schedule=eager_1f1b`;
see `residual_cnn_pipeline.flags`.
"""

from dist_loop.parallel.modes.pipeline.classic import warmup_then_alternate
from dist_loop.parallel.modes.pipeline.schedule import SCHEDULES


@SCHEDULES.register("eager_1f1b")
def eager_1f1b(num_stages: int, num_microbatches: int):
  # One forward deeper than 1F1B's K-k-1 on every stage but the last.
  last = num_stages - 1
  return warmup_then_alternate(
      [min(num_stages - k, num_microbatches) if k < last else 0
       for k in range(num_stages)], num_microbatches)
