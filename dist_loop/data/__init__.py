"""Datasets (a name registry) and the sharded input pipeline."""

from dist_loop.data import digits, mnist, synthetic  # Registers the loaders.
from dist_loop.data.base import DATASETS, Split
from dist_loop.data.pipeline import eval_dataset, train_dataset_fn

__all__ = ["DATASETS", "Split", "eval_dataset", "train_dataset_fn"]
