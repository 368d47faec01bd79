"""`run(config)`: the whole training run, from a Config to summary.json.

Order matters here (the write order is `dist_loop/workdir.py`'s). Everything
that can fail on bad input (flags, the workdir's state, devices, data,
model) happens before anything is written, so an error at the door leaves
an existing run exactly as it was. The run holds the workdir's lock from
before TensorFlow's devices are configured to the end. The latest readable
checkpoint is restored before flags.txt is written; then the controller
takes over. The cluster (`TF_CONFIG`) is read once, here, and passed down.
"""

import os
from typing import Dict, Optional

import keras
import tensorflow as tf
from absl import logging

from dist_loop import actions, checkpoints, configure, console, data
from dist_loop import devices, tasks
from dist_loop import cluster as cluster_lib
from dist_loop import preemption
from dist_loop import workdir as workdir_lib
from dist_loop.config import Config
from dist_loop.controller import Controller
from dist_loop.errors import UserError
from dist_loop.evaluation import Evaluator
from dist_loop.files import atomic_write_text
from dist_loop.modes import MODES, build_trainer
from dist_loop.summaries import LOGDIR, Summaries

FLAGS_FILE = workdir_lib.FLAGS_FILE
SUMMARY_FILE = workdir_lib.SUMMARY_FILE


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
  workdir_lib.check(config, dirs=(LOGDIR,))  # Before joining a cluster.
  mode = MODES.get(config.mode)
  mode.join_cluster(config, cluster)  # Before TensorFlow starts.
  lock = workdir_lib.Lock(config.workdir, workdir_lib.lock_name(
      cluster.task_type, cluster.task_index, cluster.is_chief))
  with lock:
    workdir_lib.check(config, dirs=(LOGDIR,))  # As no other run can change it.
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
  checkpointer = checkpoints.Checkpointer(
      trainer.checkpoint_items(), workdir, config.max_checkpoints,
      trainer.is_chief, cluster.task_index)
  checkpointer.restore(trainer.scope())
  if trainer.is_chief:
    _write(os.path.join(workdir, FLAGS_FILE),
           flags_text or config.to_flagfile())
  summaries = Summaries(workdir, enabled=trainer.is_chief)
  summaries.hparams(_hparams(config))
  logging.info("%s", console.banner(config, trainer.devices, trainer.model,
                                    dataset))
  task = tasks.for_dataset(dataset)
  evaluator = Evaluator(trainer.model, dataset, config.eval_batch_size, task)
  controller = Controller(
      config, trainer, checkpointer, summaries,
      actions.standard(config, trainer, evaluator, checkpointer, summaries,
                       task),
      os.path.join(workdir, SUMMARY_FILE) if trainer.is_chief else None,
      metric_names=task.metric_names,
      agreement=preemption.Agreement.for_run(trainer, cluster))
  try:
    return controller.run()
  finally:
    summaries.close()


def _write(path: str, text: str) -> None:
  try:
    atomic_write_text(path, text)
  except OSError as e:
    raise UserError(f"cannot write {path} ({e.strerror}); nothing else was "
                    "written. Free some space, or fix its permissions"
                    ) from None


def _hparams(config: Config) -> Dict[str, object]:
  """The config minus paths: what distinguishes runs in the HParams tab."""
  return {k: v for k, v in config.flat().items()
          if k not in ("workdir", "data_dir")}
