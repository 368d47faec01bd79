"""TensorBoard output: the runs of one workdir, written on the chief only.

Callers log flat, named metrics (`train/loss`, `eval/accuracy`,
`async/staleness_mean`), the names that land in summary.json; this module
alone decides where TensorBoard shows them. Under WORKDIR/tb:

  tb/train  `train/X` as tag `X`; any other name (`async/...`, `pipeline/...`,
            `comm/...`, `memory/...`, histograms, images, the step graph,
            the profile) as it is.
  tb/eval   `eval/X` as tag `X`. The two runs share tag names (`loss`,
            `accuracy`, a task's own metrics), so one chart overlays the train
            and eval curves, as with the Keras TensorBoard callback and Orbit.
  tb        the HParams session (the run's flags, the final metrics declared),
            the custom-scalars layout, and the final throughput and wall time
            from summary.json (what the HParams table shows for them).

`tensorboard --logdir runs/` then shows `default/tb/train`,
`default/tb/eval`, ...: runs named after their workdirs. Non-chief processes
get writers that do nothing, so callers never branch on the role.

A write that fails (a full disk) is one `UserError` naming the directory
and the newest checkpoint, which a rerun resumes from; after it every
write does nothing, so the run's clean-up (a flush, the close) does not
raise again over it.
"""

import errno
import functools
import os
import re
from typing import Dict, Mapping, Optional, Set, Tuple

import numpy as np
import tensorflow as tf
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import summary as custom_scalar
from tensorboard.plugins.hparams import api as hp
from tensorboard.plugins.hparams import plugin_data_pb2

from dist_loop.core.errors import UserError
from dist_loop.runtime.checkpoint_names import newest_checkpoint_note
from dist_loop.runtime.files import reason

LOGDIR = "tb"
TRAIN, EVAL = "train", "eval"
SESSION = ""  # The HParams session: LOGDIR itself, the parent of the runs.

# The outcome columns of the HParams table: (run relative to the session,
# tag, display name). The eval metrics are the eval run's last values; the
# `final/` ones are written from summary.json by `final()`.
HPARAMS_METRICS = (
    (EVAL, "loss", "eval loss"),
    (EVAL, "accuracy", "eval accuracy"),
    (SESSION, "final/examples_per_sec", "examples/sec"),
    (SESSION, "final/wall_time_s", "wall time (s)"),
)
# TensorBoard shows five hparams columns at first, those marked `differs`
# first; it computes `differs` only for experiments nobody declared. These
# are the flags that most often tell runs apart.
HPARAMS_COLUMNS = ("mode", "num_devices", "model", "global_batch_size",
                   "learning_rate")
FINAL_KEYS = ("examples_per_sec", "updates_per_sec", "wall_time_s")

# The custom-scalars layout: category -> [(chart title, tag regex)]. A chart
# is laid out when the run wrote a tag that it matches.
CUSTOM_SCALARS = (
    ("train and eval", (
        ("loss (train and eval)", r"^loss$"),
        ("accuracy (train and eval)", r"^accuracy$"),
    )),
    ("staleness", (
        ("async staleness: mean and max", r"^async/staleness_(mean|max)$"),
        ("ps staleness: mean and max", r"^ps/staleness_(mean|max)$"),
    )),
    ("pipeline", (
        ("bubble: measured and predicted", r"^pipeline/bubble_"),
    )),
    ("throughput", (
        ("examples per second", r"^examples_per_sec$"),
        ("steps and applied updates per second (and async workers' steps)",
         r"^(steps_per_sec|updates_per_sec|async/worker\d+_steps_per_sec)$"),
    )),
)


def _writes(method):
  """Marks a method that writes events: see the module docstring."""

  @functools.wraps(method)
  def guarded(self, *args, **kwargs):
    if self._failed:  # pylint: disable=protected-access
      return None
    try:
      return method(self, *args, **kwargs)
    except (tf.errors.OpError, OSError) as e:
      self._failed = True  # pylint: disable=protected-access
      raise self._unwritable(e) from None  # pylint: disable=protected-access

  return guarded


def _fix(error, logdir: str) -> str:
  """What to do about a failed write, by its cause: TensorFlow reports
  EACCES, EPERM and EROFS as PermissionDeniedError, without the errno."""
  code = getattr(error, "errno", None)
  if code == errno.EROFS or (isinstance(error, tf.errors.PermissionDeniedError)
                             and "read-only" in str(error).lower()):
    return "Use a workdir on a filesystem mounted read-write"
  if code in (errno.EACCES, errno.EPERM) or isinstance(
      error, tf.errors.PermissionDeniedError):
    return f"Fix the permissions of {logdir}"
  return "Free some space"


def route(name: str) -> Tuple[str, str]:
  """The (run, tag) under which TensorBoard shows a flat metric name."""
  head, slash, tail = name.partition("/")
  if slash and head in (TRAIN, EVAL):
    return head, tail
  return TRAIN, name


class Summaries:
  """Scalars, histograms, images, hyperparameters, the step graph, the
  profile and the custom-scalars layout of one run."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    self.workdir = workdir
    self.logdir = os.path.join(workdir, LOGDIR)
    self.trial_id = os.path.basename(os.path.normpath(os.path.abspath(
        workdir)))
    self._scalar_tags: Set[str] = set()
    self._tracing = False
    self._profiling = False
    self._closed = False
    self._failed = False
    try:
      self._writers = {
          run: (tf.summary.create_file_writer(os.path.join(self.logdir, run))
                if enabled else tf.summary.create_noop_writer())
          for run in (SESSION, TRAIN, EVAL)}
    except (tf.errors.OpError, OSError) as e:
      raise self._unwritable(e) from None

  def _unwritable(self, error) -> UserError:
    return UserError(
        f"cannot write TensorBoard events under {self.logdir} "
        f"({reason(error)}); {newest_checkpoint_note(self.workdir)}. "
        f"{_fix(error, self.logdir)}, then rerun the same command to resume")

  def run_dir(self, run: str) -> str:
    return os.path.join(self.logdir, run)

  @_writes
  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    for name, value in values.items():
      run, tag = route(name)
      self._scalar_tags.add(tag)
      with self._writers[run].as_default(step=step):
        tf.summary.scalar(tag, value)

  @_writes
  def histograms(self, step: int, values: Mapping[str, np.ndarray]) -> None:
    for name, value in values.items():
      run, tag = route(name)
      with self._writers[run].as_default(step=step):
        tf.summary.histogram(tag, value)

  @_writes
  def images(self, step: int, values: Mapping[str, np.ndarray],
             descriptions: Optional[Mapping[str, str]] = None) -> None:
    """One image per name, in the Images tab.

    Args:
      step: the step the images belong to.
      values: name -> HWC image (uint8, or float in [0, 1]) with 1, 3 or 4
        channels (grey, RGB, RGBA), as `tf.summary.image` takes them.
      descriptions: optional markdown shown under an image's tag.

    Raises:
      ValueError: an image that is not HWC with 1, 3 or 4 channels.
    """
    for name, value in values.items():
      value = np.asarray(value)
      if value.ndim != 3 or value.shape[-1] not in (1, 3, 4):
        raise ValueError(f"image {name!r} has shape {value.shape}; "
                         "TensorBoard takes HWC with 1, 3 or 4 channels")
      run, tag = route(name)
      with self._writers[run].as_default(step=step):
        tf.summary.image(tag, value[None], max_outputs=1,
                         description=(descriptions or {}).get(name))

  @_writes
  def hparams(self, values: Dict[str, object]) -> None:
    """The run's flags as its HParams session, named after the workdir
    (the trial ID; a resumed run continues its trial), with the final
    metrics declared (`HPARAMS_METRICS`), so the HParams tab compares runs
    by outcome."""
    clean = {k: (v if isinstance(v, (bool, int, float, str)) else str(v))
             for k, v in values.items()}
    config = hp.hparams_config_pb(
        hparams=[hp.HParam(k) for k in clean],
        metrics=[hp.Metric(tag, group=group, display_name=display)
                 for group, tag, display in HPARAMS_METRICS])
    value = config.value[0]
    data = plugin_data_pb2.HParamsPluginData.FromString(
        value.metadata.plugin_data.content)
    for info in data.experiment.hparam_infos:
      info.differs = info.name in HPARAMS_COLUMNS
    value.metadata.plugin_data.content = data.SerializeToString()
    with self._writers[SESSION].as_default():
      tf.summary.experimental.write_raw_pb(config.SerializeToString(), step=0)
      hp.hparams(clean, trial_id=self.trial_id)

  @_writes
  def final(self, summary: Mapping[str, object]) -> None:
    """summary.json's throughput and wall time, as `final/...` scalars of
    the HParams session at the final step."""
    with self._writers[SESSION].as_default(step=int(summary["final_step"])):
      for key in FINAL_KEYS:
        if summary.get(key) is not None:
          tf.summary.scalar(f"final/{key}", float(summary[key]))

  def trace_begin(self) -> None:
    """Starts recording the graph of the next traced tf.function."""
    if self.enabled and not self._tracing:
      tf.summary.trace_on(graph=True, profiler=False)
      self._tracing = True

  @_writes
  def trace_end(self, step: int) -> None:
    if self._tracing:
      with self._writers[TRAIN].as_default(step=step):
        tf.summary.trace_export("train_step", step=step)
      self._tracing = False

  def profile_begin(self) -> None:
    """Starts a TF profiler trace; it lands in the train run's Profile
    tab."""
    if self.enabled and not self._profiling:
      tf.profiler.experimental.start(self.run_dir(TRAIN))
      self._profiling = True

  @_writes
  def profile_end(self) -> None:
    if self._profiling:
      tf.profiler.experimental.stop()
      self._profiling = False

  @_writes
  def flush(self) -> None:
    for writer in self._writers.values():
      writer.flush()

  def close(self) -> None:
    """Writes the custom-scalars layout, then closes. Safe to call twice;
    after a failed write it only lets the writers go."""
    if self._closed:
      return
    self._closed = True
    try:
      self._close()
    finally:
      if self._failed:
        for writer in self._writers.values():
          try:
            writer.close()
          except tf.errors.OpError:
            pass  # What it held is lost; the failure was reported.

  @_writes
  def _close(self) -> None:
    self.profile_end()
    layout = custom_scalars_layout(self._scalar_tags)
    if self.enabled and layout.category:
      with self._writers[SESSION].as_default(step=0):
        tf.summary.experimental.write_raw_pb(
            custom_scalar.pb(layout).SerializeToString(), step=0)
    for writer in self._writers.values():
      writer.close()


def custom_scalars_layout(tags) -> layout_pb2.Layout:
  """The charts of `CUSTOM_SCALARS` that match at least one of `tags`."""
  layout = layout_pb2.Layout()
  for title, charts in CUSTOM_SCALARS:
    matched = [(name, regex) for name, regex in charts
               if any(re.search(regex, tag) for tag in tags)]
    if matched:
      category = layout.category.add(title=title)
      for name, regex in matched:
        category.chart.add(
            title=name,
            multiline=layout_pb2.MultilineChartContent(tag=[regex]))
  return layout
