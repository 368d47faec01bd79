"""The flags of --mode=pipeline."""

import dataclasses

from dist_loop.core.options import option
from dist_loop.parallel.modes.pipeline import schedule

STAGE_SPLITS = ("auto", "params", "explicit")
RECOMPUTE = ("never", "always", "except_last")
TIMING = ("log", "every", "never")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
  """Stages (devices), micro-batches, the schedule, and recomputation.

  A stage is a device of one pipeline; a chunk is a group of consecutive
  layers, and a stage holds one chunk, or V of them (`virtual_stages`).
  """

  num_stages: int = option(
      2, "Pipeline stages K: the devices of one pipeline; --num_devices=R*K "
      "runs R data-parallel pipelines.", lower=1, layout=True)
  stage_split: str = option(
      "auto", "How the layers are cut into the schedule's chunks (one or V per "
      "stage): auto (the model's own split if it declares one, else "
      "balance measured time, which may cut another run differently), "
      "params (balance parameter counts), explicit (--split_points).",
      choices=STAGE_SPLITS, layout=True)
  split_points: str = option(
      "", "For --stage_split=explicit: C-1 increasing layer indices where "
      "chunks start (C chunks: K, or K*V with --virtual_stages), e.g. 2,4.",
      layout=True)
  num_microbatches: int = option(
      4, "Micro-batches M per replica batch; use M >= 4K for a small "
      "bubble.", lower=1)
  pipeline_schedule: str = option(
      "1f1b", "Registered pipeline schedule (gpipe, 1f1b, interleaved_1f1b, "
      "zb_h1, zbv, or one an extension adds), or auto: the fastest one the "
      "cost model predicts within --pipeline_memory_mb, from timings, "
      "which may choose another in another run or a resume (name one to "
      "train identically under --deterministic).",
      choices=schedule.ScheduleChoices())
  virtual_stages: int = option(
      0, "Chunks of layers per device V: interleaved_1f1b puts V "
      "non-adjacent chunks on each device (bubble about (K-1)/(V*M)); zbv "
      "uses 2. 0: the schedule's own (2 for those two, 1 for the others).",
      lower=0)
  pipeline_memory_mb: float = option(
      0.0, "For --pipeline_schedule=auto: the most activation memory per "
      "device, in MB, a schedule may be predicted to keep; 0: no limit.",
      lower=0.0)
  pipeline_timing: str = option(
      "log", "Per-action timestamps (measured bubble and timeline): log "
      "times only the last step of each inner loop (so the step a log line "
      "follows), and the others carry no timestamp ops; every; never. Off "
      "under --deterministic.",
      choices=TIMING)
  recompute: str = option(
      "never", "Recompute each chunk's activations in its backward instead "
      "of keeping them between the forward and the backward.",
      choices=RECOMPUTE)
