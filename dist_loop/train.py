"""`run(config)`: the whole training run, from a Config to summary.json.

Order matters here (the write order is `dist_loop/runtime/workdir.py`'s).
Everything that can fail on bad input (flags, the workdir's state, devices, data,
model) happens before anything is written, so an error at the door leaves
an existing run exactly as it was. The run holds the workdir's lock from
before TensorFlow's devices are configured to the end. The latest readable
checkpoint is restored before flags.txt is written; then the controller
takes over. The cluster (`TF_CONFIG`) is read once, here, and passed down.

This is also where the actions get what they need from the trainer
(`actions.Inputs`), and where a run that finished diverged becomes a
`DivergedError`, after its checkpoint and summary.json are written.
"""

import dataclasses
import functools
import json
import os
from typing import Dict, Mapping, Optional

import keras
import tensorflow as tf
from absl import logging

from dist_loop import configure, data
from dist_loop import models
from dist_loop import tasks
from dist_loop.control import actions
from dist_loop.control import divergence
from dist_loop.control.controller import Controller
from dist_loop.control.evaluation import Evaluator, probe_gradients
from dist_loop.control.recovery import NonFinitePolicy
from dist_loop.core.config import Config
from dist_loop.core.errors import DivergedError, Interrupted, UserError
from dist_loop.parallel.modes import MODES, build_trainer
from dist_loop.parallel.modes.base import Report, Reporting
from dist_loop.runtime import checkpoints, console
from dist_loop.runtime import cluster as cluster_lib
from dist_loop.runtime import devices, goodput, launch_record
from dist_loop.runtime import preemption
from dist_loop.runtime import workdir as workdir_lib
from dist_loop.runtime.files import atomic_write_text
from dist_loop.runtime.summaries import LOGDIR, Summaries

FLAGS_FILE = workdir_lib.FLAGS_FILE
SUMMARY_FILE = workdir_lib.SUMMARY_FILE
PROBE_BATCH = 256  # Training examples of the histograms' gradient probe.


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
    DivergedError: the run finished diverged
    (`dist_loop/control/divergence.py`);
      its checkpoint and summary.json were written.
    Interrupted: Ctrl-C or SIGTERM, at any moment of the run.
  """
  try:
    return _run(config, flags_text, cluster)
  except KeyboardInterrupt as e:
    # Outside the training loop (which raises Interrupted itself): at
    # start-up, or while shutting down after another error, which stands.
    if isinstance(e.__context__, UserError):
      raise e.__context__ from None
    raise Interrupted(None) from None


def _run(config, flags_text, cluster):
  clock = goodput.Clock()  # Start-up's phases, written once there is a run.
  if cluster is None:
    cluster = cluster_lib.current()
  config = configure.validate(config, cluster)
  workdir_lib.check(config, dirs=(LOGDIR,))  # Before joining a cluster.
  mode = MODES.get(config.mode)
  clock.lap("build")
  mode.join_cluster(config, cluster)  # Before TensorFlow starts.
  clock.lap("join")
  lock_name = workdir_lib.lock_name(cluster.task_type, cluster.task_index,
                                    cluster.is_chief)
  lock = workdir_lib.Lock(config.workdir, lock_name)
  with lock:
    workdir_lib.check(config, dirs=(LOGDIR,))  # As no other run can change it.
    device_names = devices.configure(config.num_devices, config.device_type,
                                     config.intra_op_threads,
                                     config.inter_op_threads)
    keras.utils.set_random_seed(config.seed)
    if config.deterministic:
      tf.config.experimental.enable_op_determinism()
    dataset = data.load(config, models.image_size_for(config.model))
    # What the loader did not declare, the loaded data tells.
    configure.check_fit(config.model, config.dataset, data.given(dataset))
    # TFRecord shards: a file per input pipeline, as this mode counts them.
    data.check_pipelines(dataset, mode.input_pipelines(config, cluster))
    try:
      trainer = build_trainer(config, device_names, dataset, cluster)
      clock.lap("build")
      try:
        # flags.txt records the flags as given (--jit_compile=auto); the
        # run goes on with the trainer's config, where it is decided.
        return _train(trainer.config, trainer, dataset, cluster,
                      flags_text or config.to_flagfile(),
                      (clock, goodput.file_name(lock_name)), config)
      finally:
        trainer.close()
    except tf.errors.OpError as e:
      error = (data.input_error(e)
               or mode.cluster_error(config, cluster, e))
      if error is None:
        raise
      raise error from None


def _train(config, trainer, dataset, cluster, flags_text, record, given):
  """Everything that writes to the workdir, in order. `record` is (the
  start-up's `goodput.Clock`, the name of this process's goodput record);
  `given` the config as given, which a resume compares with flags.txt
  (`config` is the trainer's: --jit_compile decided)."""
  workdir = config.workdir
  previous_flags = workdir_lib.previous_flags(config)
  # --allow_config_change let a changed optimizer through: fresh slots.
  fresh = (("optimizer",) if previous_flags
           and config.optimizer_change(previous_flags) else ())
  # The input's own state (the count of bad records): made now that the
  # trainer's strategy is built; checkpoints without it still restore.
  input_items = data.checkpoint_items(dataset)
  checkpointer = checkpoints.Checkpointer(
      {**trainer.checkpoint_items(), **input_items}, workdir,
      config.max_checkpoints, trainer.is_chief, cluster.task_index,
      config.async_checkpoint, fresh=fresh, optional=tuple(input_items))
  clock, record_name = record
  clock.lap("build")
  resumed = checkpointer.restore(trainer.scope())
  clock.lap("restore")
  summary_path = os.path.join(workdir, SUMMARY_FILE)
  previous = _read_summary(summary_path)
  if trainer.is_chief:
    _write(os.path.join(workdir, FLAGS_FILE), flags_text)
  recorder = goodput.Recorder(os.path.join(workdir, record_name), clock, {
      "checkpoint_every": config.checkpoint_every,
      "expected_failure_interval_s": config.expected_failure_interval_s,
      "async_checkpoint": config.async_checkpoint},
      launches=launch_record.path(workdir))
  recorder.restore(checkpointer.saved_step if resumed else None, 0.0)
  recorder.write()  # Start-up is on record even if the first loop dies.
  summaries = Summaries(workdir, enabled=trainer.is_chief)
  completed = False
  try:
    summaries.hparams(_hparams(config))
    logging.info("%s", console.banner(config, trainer.devices, trainer.model,
                                      dataset, cluster))
    logging.info("%s", trainer.xla_choice)
    changed = (given.changes(previous_flags) if resumed and previous_flags
               else [])
    if changed:
      logging.info("%s", _changes_line(changed, bool(fresh)))
    recovery = NonFinitePolicy(config, checkpointer, trainer, summaries)
    inputs = _inputs(config, trainer, dataset, checkpointer, summaries,
                     summary_path if trainer.is_chief else None,
                     [recovery.summary], previous, recorder)
    run_actions = actions.standard(config, inputs)
    stop = preemption.Sigterm(
        config.grace_period_s,
        preemption.Agreement.for_run(trainer.scope, cluster))
    step = Controller(trainer, run_actions, train_steps=config.train_steps,
                      steps_per_loop=config.steps_per_loop,
                      recovery=recovery, stop=stop, goodput=recorder).run()
    summary = next(a for a in run_actions
                   if isinstance(a, actions.Summary)).written
    completed = True
  finally:
    checkpointer.close()  # An error ends the run: its save still completes.
    recorder.write(final=completed)
    summaries.close()
  if summary.get("diverged"):
    raise DivergedError(divergence.message(summary["diverged"], step),
                        summary)
  return summary


def _changes_line(changes, fresh_optimizer: bool) -> str:
  """One line: the flags changed since the checkpoint, which apply from the
  resumed step on (the learning rate is the schedule's, never the
  checkpoint's)."""
  return "changed since the checkpoint: " + "; ".join(
      c + (" (its slots start fresh)"
           if fresh_optimizer and c.startswith("--optimizer:") else "")
      for c in changes)


def _inputs(config, trainer, dataset, checkpointer, summaries, summary_path,
            summary_parts, previous, recorder) -> actions.Inputs:
  """What the actions need, taken from the trainer here and only here."""
  task = tasks.for_dataset(dataset)
  reporting = isinstance(trainer, Reporting)
  if reporting:
    summary_parts = [*summary_parts, trainer.summary]
  summary_parts = [*summary_parts, lambda: {  # data/bad_records: bad_records
      k.split("/")[-1]: v for k, v in data.input_metrics(dataset).items()}]
  report = trainer.report if reporting else None
  if data.input_metrics(dataset):  # In every mode, whatever it reports.
    report = functools.partial(_with_input_metrics, report, dataset)
  return actions.Inputs(
      summaries=summaries,
      evaluator=Evaluator(trainer.model, dataset, config.eval_batch_size,
                          task),
      scope=trainer.scope,
      checkpointer=checkpointer,
      metric_names=task.metric_names,
      # What `report` adds (bits per byte) is named by calling it.
      reported_names=tuple(task.report(
          {name: 1.0 for name in task.metric_names})),
      learning_rate=lambda step: trainer.recipe.schedule.value(max(step, 1)),
      devices=trainer.devices,
      model=trainer.model,
      probe_batch=(dataset.train_x[:PROBE_BATCH],
                   dataset.train_y[:PROBE_BATCH]),
      # One callable for the whole run: `on_master` traces once per callable.
      probe_gradients=functools.partial(
          trainer.on_master, functools.partial(probe_gradients, task)),
      report=report,
      tokens_per_example=task.predictions_per_example(dataset.train_y),
      summary_path=summary_path,
      summary_parts=summary_parts,
      previous=previous,
      goodput=recorder)


def _with_input_metrics(report, dataset) -> Report:
  """The mode's report (or none) and the input's scalars (`data/...`)."""
  out = report() if report is not None else Report()
  return dataclasses.replace(out, scalars={**out.scalars,
                                           **data.input_metrics(dataset)})


def _read_summary(path: str) -> Mapping[str, object]:
  """The summary.json an earlier run left, or {} if there is none (or it
  cannot be read: it is rewritten at the end)."""
  try:
    with open(path, encoding="utf-8") as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return {}
  return summary if isinstance(summary, dict) else {}


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
