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

from dist_loop.pipeline.schedule import SCHEDULES, B, F


@SCHEDULES.register("eager_1f1b")
def eager_1f1b(num_stages: int, num_microbatches: int):
  k_total, m = num_stages, num_microbatches
  schedule = []
  for k in range(k_total):
    warmup = min(k_total - k if k < k_total - 1 else 0, m)
    actions = [F(i) for i in range(warmup)]
    for j in range(m - warmup):
      actions += [F(warmup + j), B(j)]
    actions += [B(j) for j in range(m - warmup, m)]
    schedule.append(actions)
  return schedule
