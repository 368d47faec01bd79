"""The typed, frozen run configuration that the library receives.

Flags live in `experiments/`; they are turned into a `Config` there. Nothing in
`dist_loop/` reads absl FLAGS, so tests and other front ends build a `Config`
directly. `validate()` holds the rules that do not need TensorFlow, and the
flag layer calls it at parse time, so a bad combination fails before any work.
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

from dist_loop import cluster
from dist_loop.errors import UserError

DEVICE_TYPES = ("auto", "cpu", "gpu")
COMPRESSIONS = ("none", "fp16", "bf16")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
NONFINITE_POLICIES = ("raise", "skip", "rollback")
# Changing these on an existing workdir changes what the checkpoint means
# (its variables, their placement, or the data position of a step).
LAYOUT_FIELDS = ("dataset", "model", "num_devices", "num_stages",
                 "stage_split", "split_points", "async_workers",
                 "global_batch_size", "grad_accum_steps")


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
  profile_steps: str = ""  # "a,b": TF profiler trace of steps a..b.
  precision: str = "float32"
  grad_accum_steps: int = 1
  # -- reliability --
  nonfinite: str = "raise"
  max_rollbacks: int = 3
  grace_period_s: float = 30.0
  allow_config_change: bool = False
  allreduce_bytes_per_pack: int = 0
  allreduce_compression: str = "none"
  eval_batch_size: int = 256
  max_checkpoints: int = 3
  intra_op_threads: int = 0
  inter_op_threads: int = 0
  # -- pipeline (checked by PipelineTrainer.validate_config) --
  num_stages: int = 2
  stage_split: str = "auto"
  split_points: str = ""
  num_microbatches: int = 4
  pipeline_schedule: str = "1f1b"
  recompute: str = "never"
  # -- async (checked by AsyncTrainer.validate_config) --
  async_workers: int = 0
  max_staleness: int = -1
  staleness_lr: str = "none"
  async_compensation: str = "none"
  dc_lambda: float = 0.04
  # -- sync and async: WORKER:FACTOR, one worker FACTOR times slower --
  straggler: Optional[str] = None
  # -- multiple processes (TF_CONFIG): multi-worker sync and ps --
  collective_timeout_s: float = 120.0
  ps_steps_per_call: int = 4

  def validate(self) -> "Config":
    """Checks the rules that span fields. Returns self; raises UserError."""
    # Registries are imported here, not at the top: they pull in TensorFlow.
    from dist_loop import data, models, modes, optim  # pylint: disable=g-import-not-at-top
    trainer_class = modes.MODES.get(self.mode)
    models.MODELS.get(self.model)
    data.DATASETS.get(self.dataset)
    optim.OPTIMIZERS.get(self.optimizer)
    _check_choice("device_type", self.device_type, DEVICE_TYPES)
    _check_choice("precision", self.precision, PRECISIONS)
    _check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
    if self.max_rollbacks < 0 or not self.grace_period_s > 0:
      raise UserError("--max_rollbacks must be >= 0 and --grace_period_s > 0")
    _check_choice("allreduce_compression", self.allreduce_compression,
                  COMPRESSIONS)
    for name in ("num_devices", "global_batch_size", "train_steps",
                 "steps_per_loop", "log_every", "eval_every",
                 "checkpoint_every", "eval_batch_size", "max_checkpoints",
                 "ps_steps_per_call"):
      if getattr(self, name) < 1:
        raise UserError(f"--{name} must be at least 1, got {getattr(self, name)}")
    for name in ("histogram_every", "allreduce_bytes_per_pack",
                 "intra_op_threads", "inter_op_threads"):
      if getattr(self, name) < 0:
        raise UserError(f"--{name} must be >= 0, got {getattr(self, name)}")
    if not self.collective_timeout_s > 0:
      raise UserError("--collective_timeout_s must be > 0, got "
                      f"{self.collective_timeout_s}")
    if not self.learning_rate > 0:
      raise UserError(f"--learning_rate must be > 0, got {self.learning_rate}")
    self.profile_range  # pylint: disable=pointless-statement
    if cluster.current().num_tasks > 1 and not trainer_class.multi_process:
      raise UserError(f"--mode={self.mode} runs in one process, but "
                      "TF_CONFIG describes a cluster; unset TF_CONFIG, or use "
                      "--mode=sync or --mode=ps")
    trainer_class.check_capabilities(self)
    trainer_class.validate_config(self)
    return self

  @property
  def profile_range(self) -> Optional[Tuple[int, int]]:
    """(first, last) step to profile, both included, or None."""
    if not self.profile_steps:
      return None
    try:
      first, last = (int(p) for p in self.profile_steps.split(","))
    except ValueError:
      raise UserError(f"--profile_steps={self.profile_steps!r} must be two "
                      "steps FIRST,LAST, for example --profile_steps=20,25"
                      ) from None
    if not 1 <= first <= last <= self.train_steps:
      raise UserError(f"--profile_steps={self.profile_steps} must satisfy "
                      f"1 <= FIRST <= LAST <= --train_steps={self.train_steps}")
    return first, last

  def to_flagfile(self) -> str:
    """The config as a flagfile (what WORKDIR/flags.txt holds)."""
    lines = []
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is None:
        continue
      if isinstance(value, bool):
        lines.append(f"--{'' if value else 'no'}{field.name}")
      else:
        lines.append(f"--{field.name}={value}")
    return "\n".join(lines) + "\n"

  def layout_changes(self, previous_flagfile: str) -> List[str]:
    """`--name: old -> new` for each layout field that differs from a
    previous run's flags.txt (fields it does not mention are not compared)."""
    old = parse_flagfile(previous_flagfile)
    new = parse_flagfile(self.to_flagfile())
    return [f"--{k}: {old[k]} -> {new.get(k)}" for k in LAYOUT_FIELDS
            if k in old and old[k] != new.get(k)]

  def replace(self, **changes) -> "Config":
    return dataclasses.replace(self, **changes)


def parse_flagfile(text: str) -> Dict[str, str]:
  """`--name=value` lines to {name: value}; `--flag`/`--noflag` to
  "True"/"False". Comments, blank lines and nested flagfiles are skipped."""
  values = {}
  for line in text.splitlines():
    line = line.strip()
    if not line.startswith("--") or line.startswith("--flagfile"):
      continue
    name, eq, value = line[2:].partition("=")
    if not eq:
      name, value = (name[2:], "False") if name.startswith("no") else (
          name, "True")
    values[name] = value
  return values


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
