"""The typed, frozen run configuration that the library receives.

`Config` holds the run-wide fields; the chosen mode's, model's and dataset's
own settings travel in `mode_options`, `model_options` and `dataset_options`,
instances of the options dataclasses they declare (`dist_loop/options.py`).
This module imports nothing above it and reads no environment, so a
`Config` means the same thing wherever it is built.
`validate()` checks the rules that need neither TensorFlow nor a registry;
`dist_loop.configure` adds the rules that do.
"""

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from dist_loop import options as options_lib
from dist_loop.errors import UserError

DEVICE_TYPES = ("auto", "cpu", "gpu")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
NONFINITE_POLICIES = ("raise", "skip", "rollback")
# Changing these on an existing workdir changes what the checkpoint means
# (its variables, or the data position of a step). Modes add their own
# (`option(..., layout=True)`).
LAYOUT_FIELDS = ("dataset", "model", "num_devices", "global_batch_size",
                 "grad_accum_steps")
COMPONENT_FIELDS = ("mode_options", "model_options", "dataset_options")


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
  nonfinite: str = "raise"
  max_rollbacks: int = 3
  # A step whose loss is above this is treated like a non-finite one
  # (--nonfinite); 0: no bound.
  max_loss: float = 0.0
  # A run stops once this many steps in a row were skipped (their update
  # not applied: --nonfinite=skip, or a float16 loss-scale overflow).
  max_consecutive_skips: int = 50
  # A run whose last logged loss is this many times its first is reported
  # as diverged (and so is a non-finite evaluation); 0: never.
  diverged_loss_ratio: float = 10.0
  grace_period_s: float = 30.0
  allow_config_change: bool = False
  eval_batch_size: int = 256
  max_checkpoints: int = 3
  intra_op_threads: int = 0
  inter_op_threads: int = 0
  # Multi-process runs: a collective (or, in ps mode, a round without an
  # applied update) that waits this long for a peer fails.
  collective_timeout_s: float = 120.0
  # Multi-process runs: joining the cluster fails if a peer has not come up
  # after this long.
  join_timeout_s: float = 300.0
  # The options dataclasses of the chosen mode, model and dataset (a
  # registered component may declare `Options`); None means no options or
  # their defaults (`dist_loop.configure.validate` fills them in).
  mode_options: Any = None
  model_options: Any = None
  dataset_options: Any = None

  def validate(self) -> "Config":
    """Checks the run-wide rules. Returns self; raises UserError."""
    _check_choice("device_type", self.device_type, DEVICE_TYPES)
    _check_choice("precision", self.precision, PRECISIONS)
    _check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
    if self.max_rollbacks < 0 or not self.grace_period_s > 0:
      raise UserError("--max_rollbacks must be >= 0 and --grace_period_s > 0")
    if not self.max_loss >= 0:  # NaN too.
      raise UserError(f"--max_loss must be >= 0 (0: no bound), got "
                      f"{self.max_loss}")
    for name in ("num_devices", "global_batch_size", "train_steps",
                 "steps_per_loop", "log_every", "eval_every",
                 "checkpoint_every", "eval_batch_size", "max_checkpoints",
                 "grad_accum_steps"):
      if getattr(self, name) < 1:
        raise UserError(
            f"--{name} must be at least 1, got {getattr(self, name)}")
    for name in ("histogram_every", "intra_op_threads", "inter_op_threads"):
      if getattr(self, name) < 0:
        raise UserError(f"--{name} must be >= 0, got {getattr(self, name)}")
    if self.max_consecutive_skips < 1:
      raise UserError("--max_consecutive_skips must be at least 1, got "
                      f"{self.max_consecutive_skips}")
    if not self.diverged_loss_ratio >= 0:
      raise UserError("--diverged_loss_ratio must be >= 0 (0: never), got "
                      f"{self.diverged_loss_ratio}")
    if not self.join_timeout_s > 0:
      raise UserError(f"--join_timeout_s must be > 0, got "
                      f"{self.join_timeout_s}")
    if not self.collective_timeout_s > 0:
      raise UserError("--collective_timeout_s must be > 0, got "
                      f"{self.collective_timeout_s}")
    if not self.learning_rate > 0:
      raise UserError(f"--learning_rate must be > 0, got {self.learning_rate}")
    if not self.workdir:
      raise UserError("--workdir is empty; name the run's directory, for "
                      "example --workdir=runs/default")
    self.profile_range  # pylint: disable=pointless-statement
    for options in self.component_options():
      options_lib.check(options)
    return self

  def component_options(self) -> Tuple[Any, ...]:
    return (self.mode_options, self.model_options, self.dataset_options)

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

  def flat(self) -> Dict[str, Any]:
    """Every run-wide field and mode option by flag name (no None values)."""
    values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
              if f.name not in COMPONENT_FIELDS}
    for options in self.component_options():
      values.update(options_lib.as_dict(options))
    return {k: v for k, v in values.items() if v is not None}

  def to_flagfile(self) -> str:
    """The config as a flagfile (what WORKDIR/flags.txt holds)."""
    lines = []
    for name, value in self.flat().items():
      if isinstance(value, bool):
        lines.append(f"--{'' if value else 'no'}{name}")
      else:
        lines.append(f"--{name}={value}")
    return "\n".join(lines) + "\n"

  def layout_changes(self, previous_flagfile: str) -> List[str]:
    """`--name: old -> new` for each layout field that differs from a
    previous run's flags.txt. Fields one side does not mention (an option
    of another mode) are not compared: checkpoints do not depend on the
    mode."""
    old = parse_flagfile(previous_flagfile)
    new = parse_flagfile(self.to_flagfile())
    fields = LAYOUT_FIELDS + sum(
        (options_lib.layout_fields(o) for o in self.component_options()), ())
    return [f"--{k}: {old[k]} -> {new[k]}" for k in fields
            if k in old and k in new and old[k] != new[k]]

  def replace(self, **changes) -> "Config":
    return dataclasses.replace(self, **changes)

  def replace_options(self, **changes) -> "Config":
    """A copy with some mode, model or dataset options changed."""
    new = {}
    for field in COMPONENT_FIELDS:
      options = getattr(self, field)
      names = set(options_lib.as_dict(options))
      mine = {k: v for k, v in changes.items() if k in names}
      if mine:
        new[field] = dataclasses.replace(options, **mine)
    unknown = set(changes) - {k for o in new.values()
                              for k in options_lib.as_dict(o)}
    if unknown:
      raise UserError(f"unknown options {sorted(unknown)}")
    return dataclasses.replace(self, **new)


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
