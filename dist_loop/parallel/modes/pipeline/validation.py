"""The rules of --mode=pipeline, checked before any work.

The options' own bounds and choices are checked with every option
(`dist_loop/core/options.py`); these are the rules that relate them to each
other, to the device count, the batch and the model.
"""

from typing import Optional

import tensorflow as tf

from dist_loop import models
from dist_loop.core.config import Config, check_divisible
from dist_loop.core.errors import UserError
from dist_loop.parallel.modes.pipeline import partition
from dist_loop.parallel.modes.pipeline import schedule as schedule_lib


def check(config: Config, num_replicas: int) -> None:
  """Raises a UserError naming the fix for a run that cannot pipeline.

  Args:
    config: the run's configuration (`mode_options` a PipelineOptions).
    num_replicas: R, the data-parallel copies of the pipeline.
  """
  options = config.mode_options
  k, m = options.num_stages, options.num_microbatches
  if k > config.num_devices:
    raise UserError(
        f"--num_stages={k} needs {k} devices but --num_devices="
        f"{config.num_devices}; use --num_devices={k} (or R*{k} for R "
        "data-parallel pipelines) or fewer stages")
  if config.num_devices % k:
    lower = config.num_devices - config.num_devices % k
    raise UserError(
        f"--num_devices={config.num_devices} is not a multiple of "
        f"--num_stages={k}; use --num_devices={lower} or {lower + k}")
  check_divisible(config.global_batch_size, num_replicas)
  per_replica = config.global_batch_size // num_replicas
  if per_replica % m:
    fits = [d for d in range(1, per_replica + 1) if per_replica % d == 0]
    near = [d for d in fits if d < m][-1:] + [d for d in fits if d > m][:1]
    raise UserError(
        f"--num_microbatches={m} does not divide the per-replica batch "
        f"{per_replica} (--global_batch_size={config.global_batch_size} "
        f"over {num_replicas} replica(s)); use --num_microbatches="
        f"{' or '.join(map(str, sorted(near)))}")
  chunks, why = _check_schedule(options)
  _check_split(config, k, chunks, why)


def xla_refusal(config: Config, num_replicas: int) -> Optional[str]:
  """Why --jit_compile cannot compile this pipeline (a valid one), or None.

  An XLA computation runs on one device and reads only variables on it:
  the chunks of data-parallel pipelines read replica 0's variables on
  other devices. A schedule that splits the backward into I and W needs
  the forward's own ops, which XLA fuses (`chunk.py`).
  """
  options = config.mode_options
  k = options.num_stages
  if num_replicas > 1:
    return (f"--jit_compile cannot compile {num_replicas} data-parallel "
            f"pipelines (--num_devices={config.num_devices} over "
            f"--num_stages={k}): their chunks read replica 0's variables on "
            f"other devices, which XLA cannot; use --num_devices={k}, or "
            "drop --jit_compile")
  if options.pipeline_schedule != schedule_lib.AUTO and (
      schedule_lib.splits_backward(schedule_lib.make(
          options.pipeline_schedule, k, options.num_microbatches,
          options.virtual_stages))):
    return (f"--jit_compile cannot compile --pipeline_schedule="
            f"{options.pipeline_schedule}: it splits the backward at ops that "
            "XLA fuses; use --pipeline_schedule=1f1b, gpipe or "
            "interleaved_1f1b, or drop --jit_compile")
  return None


def _check_schedule(options):
  """The named schedule's chunk count (K for auto), and where it comes
  from; raises UserError if it cannot run (K, M, V)."""
  k = options.num_stages
  if options.pipeline_schedule == schedule_lib.AUTO:
    return k, ""
  if options.pipeline_memory_mb:
    raise UserError("--pipeline_memory_mb is only read with "
                    "--pipeline_schedule=auto; add it or drop "
                    "--pipeline_memory_mb")
  schedule = schedule_lib.make(options.pipeline_schedule, k,
                               options.num_microbatches,
                               options.virtual_stages)
  if schedule.num_chunks == k:
    return k, ""
  return schedule.num_chunks, (
      f"--pipeline_schedule={options.pipeline_schedule} ({k} devices x "
      f"{schedule.virtual_stages} chunks)")


def _check_split(config: Config, k: int, chunks: int, why: str) -> None:
  options = config.mode_options
  points = partition.parse_split_points(options.split_points)
  if points and options.stage_split != "explicit":
    raise UserError("--split_points is only read with "
                    "--stage_split=explicit; add it or drop --split_points")
  num_layers = count_layers(config)
  if num_layers is not None and k > num_layers:
    raise UserError(f"--num_stages={k} but model {config.model!r} has "
                    f"{num_layers} layers; use at most {num_layers} stages")
  if num_layers is not None and chunks > num_layers:
    raise UserError(f"{why} needs {chunks} chunks of layers but model "
                    f"{config.model!r} has {num_layers} layers; use fewer "
                    "--num_stages or --virtual_stages")
  if options.stage_split == "explicit":
    if not points:
      raise UserError("--stage_split=explicit needs --split_points, "
                      f"{chunks - 1} layer indices such as "
                      f"{','.join(str(i + 1) for i in range(chunks - 1))}")
    if num_layers is not None:
      partition.check_split_points(points, chunks, num_layers, why)


def count_layers(config: Config) -> Optional[int]:
  """The number of layers of the run's model, without building it.

  A builder's layer list does not depend on the input shape here; one that
  does and fails on a placeholder shape is checked at the real build. The
  layers are made in a graph of their own: one that makes a variable as it
  is constructed (Dropout's seed state) would otherwise start TensorFlow's
  runtime before the run has configured its devices.
  """
  builder = models.MODELS.get(config.model)
  size = getattr(builder, "image_size", None)
  shape = (size, size, 1) if size else (1,)
  kwargs = {}
  if hasattr(builder, "Options"):
    kwargs["options"] = (config.model_options if config.model_options
                         is not None else builder.Options())
  try:
    with tf.Graph().as_default():
      return len(builder(shape, 10, **kwargs))
  except Exception:  # pylint: disable=broad-except
    return None
