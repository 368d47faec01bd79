"""Pipeline model parallelism (--mode=pipeline)."""
# Importing the trainer registers the mode.
from dist_loop.modes.pipeline.options import PipelineOptions  # noqa: F401
from dist_loop.modes.pipeline.trainer import PipelineTrainer  # noqa: F401
