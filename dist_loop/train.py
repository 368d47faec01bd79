"""`run(config)`: the whole training run, from a Config to summary.json.

Order matters here. Everything that can fail on bad input (flags, devices,
data, model) happens before the workdir is touched, so an error at the door
leaves an existing run exactly as it was. Then the workdir gets the resolved
flags, the latest checkpoint is restored, and the controller takes over.
The cluster (`TF_CONFIG`) is read once, here, and passed down.
"""

import os
from typing import Dict, Optional

import keras
import tensorflow as tf
from absl import logging

from dist_loop import actions, checkpoints, configure, data, devices, tasks
from dist_loop import cluster as cluster_lib
from dist_loop.config import Config
from dist_loop.controller import Controller
from dist_loop.errors import UserError
from dist_loop.evaluation import Evaluator
from dist_loop.files import atomic_write_text
from dist_loop.modes import MODES, build_trainer
from dist_loop.summaries import Summaries

FLAGS_FILE = "flags.txt"
SUMMARY_FILE = "summary.json"


def run(config: Config, flags_text: Optional[str] = None,
        cluster: Optional[cluster_lib.Cluster] = None) -> Dict[str, object]:
  """Trains as `config` says; resumes if the workdir has a checkpoint.

  Args:
    config: the run's configuration.
    flags_text: the resolved flags in flagfile format, saved as flags.txt
      (default: `config.to_flagfile()`).
    cluster: this process's place in a cluster; default: read from
      `TF_CONFIG`, here and only here.

  Returns:
    The contents of summary.json.

  Raises:
    UserError: bad input; nothing in the workdir was changed.
    NonFiniteError: the loss or gradients became non-finite.
  """
  if cluster is None:
    cluster = cluster_lib.current()
  config = configure.validate(config, cluster)
  _check_layout_unchanged(config)
  mode = MODES.get(config.mode)
  mode.join_cluster(config, cluster)  # Before TensorFlow starts.
  device_names = devices.configure(config.num_devices, config.device_type,
                                   config.intra_op_threads,
                                   config.inter_op_threads)
  keras.utils.set_random_seed(config.seed)
  if config.deterministic:
    tf.config.experimental.enable_op_determinism()
  dataset = data.load(config)
  try:
    trainer = build_trainer(config, device_names, dataset, cluster)
    try:
      return _train(config, trainer, dataset, cluster, flags_text)
    finally:
      trainer.close()
  except tf.errors.OpError as e:
    error = mode.cluster_error(config, cluster, e)
    if error is None:
      raise
    raise error from None


def _train(config, trainer, dataset, cluster, flags_text):
  """Everything that writes to the workdir, in order."""
  workdir = config.workdir
  os.makedirs(workdir, exist_ok=True)
  if trainer.is_chief:
    atomic_write_text(os.path.join(workdir, FLAGS_FILE),
                      flags_text or config.to_flagfile())
  checkpointer = checkpoints.Checkpointer(
      trainer.checkpoint_items(), workdir, config.max_checkpoints,
      trainer.is_chief, cluster.task_index)
  checkpointer.restore(trainer.scope())
  summaries = Summaries(workdir, enabled=trainer.is_chief)
  summaries.hparams(_hparams(config))
  logging.info("mode=%s devices=%s model=%s dataset=%s (%d train / %d eval)",
               config.mode, ",".join(trainer.devices), config.model,
               config.dataset, len(dataset.train_y), len(dataset.eval_y))
  task = tasks.for_dataset(dataset)
  evaluator = Evaluator(trainer.model, dataset, config.eval_batch_size, task)
  controller = Controller(
      config, trainer, checkpointer, summaries,
      actions.standard(config, trainer, evaluator, checkpointer, summaries,
                       task),
      os.path.join(workdir, SUMMARY_FILE) if trainer.is_chief else None,
      metric_names=task.metric_names)
  try:
    return controller.run()
  finally:
    summaries.close()


def _check_layout_unchanged(config: Config) -> None:
  """Refuses to resume a workdir under a different model or device layout."""
  path = os.path.join(config.workdir, FLAGS_FILE)
  if config.allow_config_change or not os.path.exists(path):
    return
  with open(path) as f:
    changes = config.layout_changes(f.read())
  if changes:
    raise UserError(
        f"{config.workdir} holds a run with other settings "
        f"({'; '.join(changes)}). Use a new --workdir, restore the old values, "
        "or pass --allow_config_change to resume anyway")


def _hparams(config: Config) -> Dict[str, object]:
  """The config minus paths: what distinguishes runs in the HParams tab."""
  return {k: v for k, v in config.flat().items()
          if k not in ("workdir", "data_dir")}
