"""Worked example: a mode that brings its own flag, as one file.

`--mode=single_device` trains on one device with no `tf.distribute`
strategy at all: a plain `tf.function` loop over the step core
(`dist_loop/step.py`), the smallest complete mode. What is left of a mode
once distribution is taken away is what every other mode adds to: the
update is the whole batch's gradients applied with `optim.apply_reduced`,
so it equals `--mode=sync --num_devices=1`.

Its flag, `--jit_compile`, compiles the step (forward, backward, update)
with XLA. It is declared once, in `SingleDeviceOptions` below: the flag
layer generates the flag from it, `Config.mode_options` carries it here, and
a run of another mode that passes it is refused. Neither
`dist_loop/config.py` nor `experiments/flags.py` knows this mode. See
`single_device.flags`.
"""

import dataclasses
from typing import Dict

import tensorflow as tf

from dist_loop import models, optim
from dist_loop import precision as precision_lib
from dist_loop import step as step_lib
from dist_loop.data import train_dataset_fn
from dist_loop.errors import NonFiniteError, UserError
from dist_loop.modes import MODES, Trainer
from dist_loop.options import option


@dataclasses.dataclass(frozen=True)
class SingleDeviceOptions:
  """The flags of --mode=single_device."""

  jit_compile: bool = option(
      False, "Compile the training step (forward, backward and update) with "
      "XLA.")


@MODES.register("single_device")
class SingleDeviceTrainer(Trainer):
  """One device, no strategy: `run_steps` over a (maybe XLA) step."""

  Options = SingleDeviceOptions
  precisions = precision_lib.PRECISIONS
  grad_accumulation = True
  skips_nonfinite = True
  checks_max_loss = True

  @classmethod
  def validate(cls, config, cluster):
    if config.num_devices != 1:
      raise UserError(
          f"--mode=single_device trains on one device, got --num_devices="
          f"{config.num_devices}; use --num_devices=1, or --mode=sync to "
          "use several")
    super().validate(config, cluster)

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    with tf.device(devices[0]):
      self.model = models.build_for(config, dataset)
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.model.trainable_variables)
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False,
                              name="step")
    self._iterator = None
    # XLA compiles the step only: the loop around it reads the iterator,
    # which XLA cannot.
    self._update = tf.function(self._update_fn,
                               jit_compile=self.options.jit_compile)
    self._loop = tf.function(self._loop_fn)

  def on_restore(self):
    self._iterator = None  # Rebuilt from the restored step.

  def close(self):
    self._iterator = None

  # -- the step: a function of (batch) on the model's variables --

  def _update_fn(self, x, y):
    scale = self.loss_scale.scale if self.loss_scale is not None else None
    chunks = self.config.grad_accum_steps
    shares, grads = step_lib.accumulated_gradients(
        self.task, self.model, x, y, chunks=chunks,
        examples_per_update=self.examples_per_step, contributors=chunks,
        scale=scale)
    grads, ok = precision_lib.unscale_and_apply(
        self.optimizer, grads, self.model.trainable_variables,
        self.loss_scale, scale)
    return shares, tf.linalg.global_norm(grads), ok

  def _step_fn(self, batch):
    shares, grad_norm, ok = self._update(*batch)
    return {**shares, "grad_norm": grad_norm}, ok, ()

  # -- the inner loop: num_steps steps in one tf.function call --

  def _loop_fn(self, iterator, num_steps):
    means, bad_step, _ = step_lib.run_steps(
        self._step_fn, iterator, num_steps, self.step,
        keys=self.task.metric_names + ("grad_norm",),
        nonfinite=self.config.nonfinite, loss_scale=self.loss_scale,
        max_loss=self.config.max_loss)
    return means, bad_step

  def train(self, num_steps: int) -> Dict[str, float]:
    if self._iterator is None:  # Built lazily: resumes at the restored step.
      fn = train_dataset_fn(self.dataset.train_x, self.dataset.train_y,
                            self.examples_per_step, self.config.seed,
                            start_step=int(self.step.numpy()))
      self._iterator = iter(fn(tf.distribute.InputContext()))
    with tf.device(self.devices[0]):
      means, bad_step = self._loop(self._iterator,
                                   tf.constant(num_steps, tf.int64))
    if int(bad_step) >= 0:
      raise NonFiniteError(int(bad_step))
    means = {k: float(v) for k, v in means.items()}
    task_means = {k: means.pop(k) for k in self.task.metric_names}
    return {f"train/{k}": v
            for k, v in {**self.task.report(task_means), **means}.items()}
