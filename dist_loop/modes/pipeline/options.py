"""The flags of --mode=pipeline."""

import dataclasses

from dist_loop.modes.pipeline import schedule
from dist_loop.options import option

STAGE_SPLITS = ("auto", "params", "explicit")
RECOMPUTE = ("never", "always", "except_last")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
  """Stages, micro-batches, the schedule, and recomputation."""

  num_stages: int = option(
      2, "Pipeline stages K; --num_devices=R*K runs R data-parallel "
      "pipelines.", lower=1, layout=True)
  stage_split: str = option(
      "auto", "How the layers are cut into stages: auto (the model's own "
      "split if it declares one, else balance measured time), params "
      "(balance parameter counts), explicit (--split_points).",
      choices=STAGE_SPLITS, layout=True)
  split_points: str = option(
      "", "For --stage_split=explicit: K-1 increasing layer indices where "
      "stages start, e.g. 2,4.", layout=True)
  num_microbatches: int = option(
      4, "Micro-batches M per replica batch; use M >= 4K for a small "
      "bubble.", lower=1)
  pipeline_schedule: str = option(
      "1f1b", "Registered pipeline schedule: gpipe, 1f1b, or one an "
      "extension adds.", choices=schedule.SCHEDULES)
  recompute: str = option(
      "never", "Recompute each stage's activations in its backward "
      "(tf.recompute_grad) instead of keeping them.", choices=RECOMPUTE)
