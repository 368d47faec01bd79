"""Worked example: a mode that brings its own flag, as one file.

`--mode=single_device` trains on one device with no `tf.distribute`
strategy at all: the loop base (`dist_loop/parallel/modes/loop.py`) over a plain
step, the smallest complete mode. What is left of a mode once distribution
is taken away is what every other mode adds to: the update is the whole
batch's gradients applied with `optim.apply_reduced`, so it equals
`--mode=sync --num_devices=1`.

With XLA on (the run-wide `--jit_compile`), its whole update (forward,
backward and the optimizer's update) is one XLA computation: without a
strategy there is no collective to keep outside it, as every other mode
must (docs/modes.md#xla). It reads `config.jit_compile` as a bool: the
default, `--jit_compile=auto`, is decided before a trainer is built, by
the rule of every mode (`dist_loop/parallel/modes/xla.py`): off on CPU,
on on GPUs, since this mode declares nothing XLA cannot compile (no
`xla_refusal`, no `xla_state_refusal`). Neither `dist_loop/core/config.py`
nor `experiments/flags.py` knows this mode. See `single_device.flags`.
"""

import tensorflow as tf

from dist_loop import models
from dist_loop.core.errors import UserError
from dist_loop.parallel.modes import MODES, LoopTrainer, StepResult
from dist_loop.training import optim
from dist_loop.training import precision as precision_lib
from dist_loop.training import step as step_core


@MODES.register("single_device")
class SingleDeviceTrainer(LoopTrainer):
  """One device, no strategy: the loop base over a (maybe XLA) step."""

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
                                  self.model.trainable_variables,
                                  config.weight_decay)
      self.loss_scale = precision_lib.make_loss_scale(config.precision)
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False,
                              name="step")
    # XLA compiles the update only: the loop around it reads the iterator,
    # which XLA cannot.
    self._update = tf.function(self._update_fn, autograph=False,
                               jit_compile=self.config.jit_compile)

  def _update_fn(self, x, y):
    scale = self.loss_scale.scale if self.loss_scale is not None else None
    chunks = self.config.grad_accum_steps
    shares, grads = step_core.accumulated_gradients(
        self.task, self.model, x, y, chunks=chunks,
        examples_per_update=self.examples_per_step, contributors=chunks,
        scale=scale)
    ok, means = precision_lib.unscale_and_apply(
        self.optimizer, grads, self.model.trainable_variables,
        self.loss_scale, scale, self.recipe, self.step)
    return shares, means, ok

  def replica_step(self, batch, variant):
    del variant
    with tf.device(self.devices[0]):
      shares, means, ok = self._update(*batch)
    return StepResult(shares, ok, means)
