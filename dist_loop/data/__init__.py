"""Datasets (a name registry), the sharded input pipeline, and shards."""

# Importing them registers them.
from dist_loop.data import digits, mnist, shards, synthetic, text
from dist_loop.data.base import (DATASETS, Dataset, check_pipelines, given,
                                 gives, load)
from dist_loop.data.shard_stream import input_error
from dist_loop.data.shards import checkpoint_items, input_metrics
from dist_loop.data.stream import eval_dataset, train_dataset_fn

__all__ = ["DATASETS", "Dataset", "check_pipelines", "checkpoint_items",
           "given", "gives", "load", "eval_dataset", "input_error",
           "input_metrics", "train_dataset_fn"]
