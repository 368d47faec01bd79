"""TensorBoard output: one writer, on the chief only.

Scalars are flat, named dictionaries (`train/loss`, `eval/accuracy`), the same
names that land in `summary.json`. Non-chief processes get a writer that does
nothing, so callers never branch on the role.
"""

import os
from typing import Dict, Mapping

import numpy as np
import tensorflow as tf
from tensorboard.plugins.hparams import api as hp

LOGDIR = "tb"


class Summaries:
  """Scalars, histograms, hyperparameters and the step graph."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    self.logdir = os.path.join(workdir, LOGDIR)
    self._writer = (tf.summary.create_file_writer(self.logdir) if enabled
                    else tf.summary.create_noop_writer())
    self._tracing = False
    self._profiling = False

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    with self._writer.as_default(step=step):
      for name, value in values.items():
        tf.summary.scalar(name, value)

  def histograms(self, step: int, values: Mapping[str, np.ndarray]) -> None:
    with self._writer.as_default(step=step):
      for name, value in values.items():
        tf.summary.histogram(name, value)

  def images(self, step: int, values: Mapping[str, np.ndarray]) -> None:
    """HWC uint8 images, one per name."""
    with self._writer.as_default(step=step):
      for name, value in values.items():
        tf.summary.image(name, value[None])

  def hparams(self, values: Dict[str, object]) -> None:
    """Logs the run's config through the HParams plugin."""
    clean = {k: (v if isinstance(v, (bool, int, float, str)) else str(v))
             for k, v in values.items()}
    with self._writer.as_default():
      hp.hparams(clean)

  def trace_begin(self) -> None:
    """Starts recording the graph of the next traced tf.function."""
    if self.enabled and not self._tracing:
      tf.summary.trace_on(graph=True, profiler=False)
      self._tracing = True

  def trace_end(self, step: int) -> None:
    if self._tracing:
      with self._writer.as_default(step=step):
        tf.summary.trace_export("train_step", step=step)
      self._tracing = False

  def profile_begin(self) -> None:
    """Starts a TF profiler trace; it lands in the Profile tab."""
    if self.enabled and not self._profiling:
      tf.profiler.experimental.start(self.logdir)
      self._profiling = True

  def profile_end(self) -> None:
    if self._profiling:
      tf.profiler.experimental.stop()
      self._profiling = False

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self.profile_end()
    self._writer.close()
