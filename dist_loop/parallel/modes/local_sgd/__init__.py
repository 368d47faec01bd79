"""Local SGD and DiLoCo: replicas synchronise every --sync_every steps."""
from dist_loop.parallel.modes.local_sgd.trainer import LocalSGDTrainer  # noqa: F401
