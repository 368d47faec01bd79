"""Pipeline model parallelism."""
from dist_loop.modes.pipeline.trainer import *  # noqa: F401,F403
from dist_loop.modes.pipeline.trainer import PipelineTrainer  # noqa: F401
