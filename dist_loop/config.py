"""The typed, frozen run configuration that the library receives.

Flags live in `experiments/`; they are turned into a `Config` there. Nothing in
`dist_loop/` reads absl FLAGS, so tests and other front ends build a `Config`
directly. `validate()` holds the rules that do not need TensorFlow, and the
flag layer calls it at parse time, so a bad combination fails before any work.
"""

import dataclasses
from typing import Optional

from dist_loop.errors import UserError

DEVICE_TYPES = ("auto", "cpu", "gpu")
COMPRESSIONS = ("none", "fp16", "bf16")


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run needs. Field names match the flags one to one."""

  workdir: str
  dataset: str = "digits"
  data_dir: Optional[str] = None
  model: str = "cnn"
  mode: str = "sync"
  num_devices: int = 1
  device_type: str = "auto"
  global_batch_size: int = 64
  train_steps: int = 1000
  optimizer: str = "adam"
  learning_rate: float = 1e-3
  seed: int = 0
  deterministic: bool = False
  steps_per_loop: int = 10
  log_every: int = 50
  eval_every: int = 200
  checkpoint_every: int = 200
  histogram_every: int = 0
  allreduce_bytes_per_pack: int = 0
  allreduce_compression: str = "none"
  eval_batch_size: int = 256
  max_checkpoints: int = 3
  intra_op_threads: int = 0
  inter_op_threads: int = 0

  def validate(self) -> "Config":
    """Checks the rules that span fields. Returns self; raises UserError."""
    # Registries are imported here, not at the top: they pull in TensorFlow.
    from dist_loop import data, models, modes, optim  # pylint: disable=g-import-not-at-top
    trainer_class = modes.MODES.get(self.mode)
    models.MODELS.get(self.model)
    data.DATASETS.get(self.dataset)
    optim.OPTIMIZERS.get(self.optimizer)
    _check_choice("device_type", self.device_type, DEVICE_TYPES)
    _check_choice("allreduce_compression", self.allreduce_compression,
                  COMPRESSIONS)
    for name in ("num_devices", "global_batch_size", "train_steps",
                 "steps_per_loop", "log_every", "eval_every",
                 "checkpoint_every", "eval_batch_size", "max_checkpoints"):
      if getattr(self, name) < 1:
        raise UserError(f"--{name} must be at least 1, got {getattr(self, name)}")
    for name in ("histogram_every", "allreduce_bytes_per_pack",
                 "intra_op_threads", "inter_op_threads"):
      if getattr(self, name) < 0:
        raise UserError(f"--{name} must be >= 0, got {getattr(self, name)}")
    if not self.learning_rate > 0:
      raise UserError(f"--learning_rate must be > 0, got {self.learning_rate}")
    trainer_class.validate_config(self)
    return self

  def replace(self, **changes) -> "Config":
    return dataclasses.replace(self, **changes)


def check_divisible(global_batch: int, replicas: int) -> None:
  """Raises UserError naming the nearest valid batch sizes."""
  if global_batch % replicas:
    lower = global_batch - global_batch % replicas
    upper = lower + replicas
    options = f"{lower} or {upper}" if lower else f"{upper}"
    raise UserError(
        f"--global_batch_size={global_batch} is not divisible by {replicas} "
        f"replicas; use {options}")


def _check_choice(name, value, choices):
  if value not in choices:
    raise UserError(
        f"unknown --{name}={value!r}; choose one of: {', '.join(choices)}")
