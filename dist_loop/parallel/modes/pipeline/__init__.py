"""Pipeline model parallelism (--mode=pipeline)."""
# Importing the schedules registers them; importing the trainer registers
# the mode.
from dist_loop.parallel.modes.pipeline import classic  # noqa: F401
from dist_loop.parallel.modes.pipeline import interleaved  # noqa: F401
from dist_loop.parallel.modes.pipeline import zero_bubble  # noqa: F401
from dist_loop.parallel.modes.pipeline.options import PipelineOptions  # noqa: F401
from dist_loop.parallel.modes.pipeline.trainer import PipelineTrainer  # noqa: F401
