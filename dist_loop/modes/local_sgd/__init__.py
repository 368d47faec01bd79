"""Local SGD and DiLoCo: replicas synchronise every --sync_every steps."""
from dist_loop.modes.local_sgd.trainer import LocalSGDTrainer  # noqa: F401
