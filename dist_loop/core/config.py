"""The typed, frozen run configuration that the library receives.

`Config` holds the run-wide fields; the chosen mode's, model's, dataset's,
schedule's and reducer's own settings travel in `mode_options`,
`model_options`, `dataset_options`, `schedule_options` and `reducer_options`,
instances of the options dataclasses they declare (`dist_loop/core/options.py`).
Each run-wide field is an `option(...)`: its help text, bounds, choices and
`--helpfull` group are declared here, next to the field, and the flag layer
generates the flags from them, so a default or a bound is written once.
This module imports nothing above it and reads no environment, so a
`Config` means the same thing wherever it is built.
`validate()` checks the rules that need neither TensorFlow nor a registry
(the declared bounds among them); `dist_loop.configure` adds the rules that
do.
"""

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from dist_loop.core import aliases
from dist_loop.core import options as options_lib
from dist_loop.core.errors import UserError
from dist_loop.core.options import MAX_FLOAT, REQUIRED, auto_option, option

DEVICE_TYPES = ("auto", "cpu", "gpu")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
NONFINITE_POLICIES = ("raise", "skip", "rollback")
COMPONENT_FIELDS = ("mode_options", "model_options", "dataset_options",
                    "schedule_options", "reducer_options")
# {layout field whose value is a registered name: name -> key}. Names with
# one key hold the same checkpoint (two stateless reducers); a registry
# above fills it in (`dist_loop/parallel/reducers`). Without: the name.
LAYOUT_KEYS: Dict[str, Callable[[str], str]] = {}

# Upper bounds. Above each, a value is a typo that would crash the process
# (or exhaust its memory) instead of failing with a message.
# numpy's seed range (keras.utils.set_random_seed seeds numpy).
MAX_SEED = 2**32 - 1
# Any count of steps: far beyond a real run, within the 32-bit integers that
# TensorFlow ops may count with, and an ETA that fits a datetime.timedelta.
MAX_STEPS = 2**31 - 1
# Examples in one batch, and in one step (--global_batch_size x
# --grad_accum_steps: a step's input holds every micro-batch): TensorFlow's
# int32 shapes overflow at 2**31, and a batch far smaller no longer fits in
# memory.
MAX_BATCH = 2**20
# More threads than cores only add switching, and 1024 is above the core
# count of any single machine; each thread reserves a stack, so 100000
# exhausted memory. A fixed number rather than a multiple of this machine's
# cores, so that a workdir's flags.txt stays valid on another machine.
MAX_THREADS = 1024
# Schedulers give seconds to minutes between SIGTERM and SIGKILL; the
# watchdog's timer fails beyond threading.TIMEOUT_MAX.
MAX_GRACE_PERIOD_S = 3600.0
# A peer that has not answered in a day is gone.
MAX_TIMEOUT_S = 86400.0

# --helpfull groups ("run: the loop").
_RUN = "the run"
_DATA = "data and model"
_OPTIMIZER = "optimizer"
_DEVICES = "devices"
_LOOP = "the loop"
_PRECISION = "precision and accumulation"
_RELIABILITY = "reliability"
_CLUSTER = "several processes (TF_CONFIG; see tools/launch.py)"


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run needs. Field names match the flags one to one."""

  workdir: str = option(
      REQUIRED, "Directory of the run: checkpoints, TensorBoard events, "
      "flags.txt, summary.json. Rerunning on the same workdir resumes.",
      group=_RUN)
  dataset: str = option("digits", "Registered dataset.", group=_DATA,
                        layout=True)
  data_dir: Optional[str] = option(
      None, "Where file-based datasets (mnist.npz) are read from; default: "
      "the Keras cache.", group=_DATA)
  model: str = option("cnn", "Registered model.", group=_DATA, layout=True)
  mode: str = option("sync", "Parallel mode.", group=_RUN)
  reducer: str = option(
      "exact", "How --mode=sync reduces gradients: a registered reducer "
      "(dist_loop/parallel/reducers), its options listed under its name.",
      group=_RUN, layout=True)
  num_devices: int = option(
      1, "Devices: logical CPU devices on a CPU-only machine, else the first "
      "N GPUs.", lower=1, group=_DEVICES, layout=True)
  device_type: str = option("auto", "auto: GPUs if present, else CPU.",
                            choices=DEVICE_TYPES, group=_DEVICES)
  global_batch_size: int = option(
      64, "Examples per step over all replicas.", lower=1, upper=MAX_BATCH,
      group=_DATA, layout=True)
  train_steps: int = option(1000, "Steps to train.", lower=1,
                            upper=MAX_STEPS, group=_RUN)
  optimizer: str = option("adam", "Registered optimizer.", group=_OPTIMIZER)
  learning_rate: float = option(
      1e-3, "Learning rate: the peak of --lr_schedule.", above=0.0,
      upper=MAX_FLOAT, group=_OPTIMIZER)
  lr_schedule: str = option(
      "constant", "Registered learning-rate schedule, a function of the "
      "step (dist_loop/training/schedules.py).", group=_OPTIMIZER)
  warmup_steps: int = option(
      0, "Linear warm-up: step s of the first W gets s/W of the rate "
      "(0: none).", lower=0, upper=MAX_STEPS, group=_OPTIMIZER)
  clip_global_norm: float = option(
      0.0, "Scale the reduced gradient of each update down to this global "
      "norm if it is above (0: no clipping). train/grad_norm stays the "
      "norm before clipping; train/clipped_fraction: how often it acted.",
      lower=0.0, upper=MAX_FLOAT, group=_OPTIMIZER)
  weight_decay: float = option(
      -1.0, "Decoupled weight decay (as AdamW): w -= lr * weight_decay * w "
      "each update, on every variable of rank >= 2 (biases and "
      "normalisation parameters excluded). -1: the optimizer's own (adamw: "
      "0.004 on every variable; the others: none).", lower=-1.0,
      upper=MAX_FLOAT, group=_OPTIMIZER)
  seed: int = option(0, "Seed of initialisation and data order.", lower=0,
                     upper=MAX_SEED, group=_RUN)
  deterministic: bool = option(
      False, "Deterministic kernels "
      "(tf.config.experimental.enable_op_determinism).", group=_RUN)
  steps_per_loop: int = option(10, "Steps per tf.function call.", lower=1,
                               upper=MAX_STEPS, group=_LOOP)
  log_every: int = option(
      50, "Steps between progress lines and train summaries.", lower=1,
      upper=MAX_STEPS, group=_LOOP)
  eval_every: int = option(200, "Steps between evaluations.", lower=1,
                           upper=MAX_STEPS, group=_LOOP)
  checkpoint_every: int = option(200, "Steps between checkpoints.", lower=1,
                                 upper=MAX_STEPS, group=_LOOP)
  async_checkpoint: bool = option(
      False, "Write checkpoints in the background: training goes on while a "
      "save is written (one at a time); the index names it once it is "
      "complete.", group=_LOOP)
  expected_failure_interval_s: float = option(
      0.0, "Mean seconds between failures, for tools.goodput's best "
      "checkpoint interval (Young/Daly); 0: the one the workdir's restarts "
      "show.", lower=0.0, upper=1e9, group=_RELIABILITY)
  histogram_every: int = option(
      0, "Steps between weight and gradient histograms (0: never).", lower=0,
      upper=MAX_STEPS, group=_LOOP)
  profile_steps: str = option(
      "", "FIRST,LAST: write a TF profiler trace of these steps to "
      "TensorBoard's Profile tab.", group=_LOOP)
  jit_compile: Union[bool, str] = auto_option(
      "Compile each replica's forward, backward and local math with XLA, "
      "in every mode whose step is traced; the collectives stay outside the "
      "compiled region. auto: on where the run trains on GPUs and its mode "
      "can compile it, off on CPU; --jit_compile or --nojit_compile forces "
      "it (docs/modes.md#xla---jit_compile).",
      group=_PRECISION)
  precision: str = option(
      "float32", "Compute dtype policy; master weights stay float32. "
      "mixed_float16 adds dynamic loss scaling.", choices=PRECISIONS,
      group=_PRECISION)
  grad_accum_steps: int = option(
      1, "Micro-steps of --global_batch_size examples each, whose gradients "
      "are summed into one update (sync, local_sgd; other modes refuse it).",
      lower=1, upper=MAX_BATCH,
      group=_PRECISION, layout=True)
  nonfinite: str = option(
      "raise", "On a NaN/Inf loss or gradient: raise (stop, naming the "
      "step), skip (drop that update on every replica), or rollback "
      "(restore the last checkpoint).", choices=NONFINITE_POLICIES,
      group=_RELIABILITY)
  max_rollbacks: int = option(
      3, "With --nonfinite=rollback: give up after this many.", lower=0,
      group=_RELIABILITY)
  max_loss: float = option(
      0.0, "A step whose loss (in nats) is above this is a divergence, "
      "handled like a non-finite step (--nonfinite=raise or rollback); 0: no "
      "bound. A bound of ~100x the first logged loss catches a run that "
      "blows up.", lower=0.0, upper=MAX_FLOAT, group=_RELIABILITY)
  max_consecutive_skips: int = option(
      50, "Stop the run once this many steps in a row were skipped "
      "(--nonfinite=skip, or float16 loss-scale overflows).", lower=1,
      upper=MAX_STEPS, group=_RELIABILITY)
  diverged_loss_ratio: float = option(
      10.0, "Report the run as diverged (a warning, summary.json, exit code "
      "3) if its last logged loss is this many times its first (above 1), "
      "or its evaluation is non-finite; 0: never.", lower=0.0,
      upper=MAX_FLOAT, group=_RELIABILITY)
  grace_period_s: float = option(
      30.0, "After SIGTERM, seconds to save a checkpoint and exit.",
      lower=0.1, upper=MAX_GRACE_PERIOD_S, group=_RELIABILITY)
  allow_config_change: bool = option(
      False, "Resume a workdir even if the model or device layout flags "
      "differ from flags.txt.", group=_RELIABILITY)
  eval_batch_size: int = option(256, "Batch size of evaluation.", lower=1,
                                upper=MAX_BATCH, group=_DATA)
  max_checkpoints: int = option(3, "Checkpoints kept.", lower=1, group=_LOOP)
  intra_op_threads: int = option(
      0, "Threads inside one op (0: TensorFlow's default, one per core).",
      lower=0, upper=MAX_THREADS, group=_DEVICES)
  inter_op_threads: int = option(
      0, "Ops run concurrently (0: TensorFlow's default, one per core).",
      lower=0, upper=MAX_THREADS, group=_DEVICES)
  collective_timeout_s: float = option(
      120.0, "Multi-worker sync and local_sgd: a collective that waits this "
      "long for a peer fails (CommunicationOptions.timeout_seconds); ps: a "
      "round of scheduled calls (every step up to the next log, evaluation or "
      "checkpoint) fails if it takes longer.", lower=0.001,
      upper=MAX_TIMEOUT_S, group=_CLUSTER)
  join_timeout_s: float = option(
      300.0, "Multi-process runs: joining the cluster fails if a peer task "
      "has not come up after this long.", lower=0.001, upper=MAX_TIMEOUT_S,
      group=_CLUSTER)
  # The options dataclasses of the chosen mode, model, dataset,
  # learning-rate schedule and reducer (a registered component may declare
  # `Options`);
  # None means no options or their defaults (`dist_loop.configure.validate`
  # fills them in).
  mode_options: Any = None
  model_options: Any = None
  dataset_options: Any = None
  schedule_options: Any = None
  reducer_options: Any = None

  def validate(self) -> "Config":
    """Checks the run-wide rules: each field's declared bounds and choices,
    then the rules between fields. Returns self; raises UserError."""
    options_lib.check(self)
    if not self.workdir:
      raise UserError("--workdir is empty; name the run's directory, for "
                      "example --workdir=runs/default")
    self.profile_range  # pylint: disable=pointless-statement
    self._check_step_size()
    if 0 < self.diverged_loss_ratio <= 1:
      raise UserError(f"--diverged_loss_ratio={self.diverged_loss_ratio:g} "
                      "would call a run whose loss did not rise diverged; use "
                      "a ratio above 1 (the default is 10), or 0 for never")
    if -1.0 < self.weight_decay < 0.0:
      raise UserError(f"--weight_decay={self.weight_decay} must be >= 0, or "
                      "-1 for the optimizer's own")
    for options in self.component_options():
      options_lib.check(options)
    return self

  def _check_step_size(self) -> None:
    """A step's input holds all its micro-batches: at most MAX_BATCH
    examples."""
    examples = self.global_batch_size * self.grad_accum_steps
    if examples > MAX_BATCH:
      raise UserError(
          f"--grad_accum_steps={self.grad_accum_steps} micro-batches of "
          f"--global_batch_size={self.global_batch_size} make {examples} "
          f"examples per step, above the {MAX_BATCH} a step can hold; use "
          f"--grad_accum_steps={MAX_BATCH // self.global_batch_size} or "
          "fewer")

  def component_options(self) -> Tuple[Any, ...]:
    return (self.mode_options, self.model_options, self.dataset_options,
            self.schedule_options, self.reducer_options)

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
    mode. A registered name is compared by its `LAYOUT_KEYS` key."""
    old = _previous(previous_flagfile)
    new = parse_flagfile(self.to_flagfile())
    fields = options_lib.layout_fields(self) + sum(
        (options_lib.layout_fields(o) for o in self.component_options()), ())

    def key(name, value):
      return LAYOUT_KEYS.get(name, lambda v: v)(value)

    return [f"--{k}: {old[k]} -> {new[k]}" for k in fields
            if k in old and k in new and key(k, old[k]) != key(k, new[k])]

  def changes(self, previous_flagfile: str) -> List[str]:
    """`--name: old -> new` for every flag that differs from a previous
    run's flags.txt (the start banner's "changed since the checkpoint").
    A run-wide flag the old file lacks (one added since) counts as its
    default; a component's option only one side has is not compared."""
    old = _previous(previous_flagfile)
    defaults = parse_flagfile(Config(workdir=self.workdir).to_flagfile())
    out = []
    for name, value in parse_flagfile(self.to_flagfile()).items():
      before = old.get(name, defaults.get(name))
      if (name not in ("workdir", "allow_config_change")
          and before is not None and before != value):
        out.append(f"--{name}: {before} -> {value}")
    return out

  def optimizer_change(self, previous_flagfile: str) -> Optional[str]:
    """The optimizer of a previous run's flags.txt, if it is another:
    its slots do not fit this run's optimizer."""
    old = parse_flagfile(previous_flagfile).get("optimizer")
    return old if old not in (None, self.optimizer) else None

  def replace(self, **changes) -> "Config":
    return dataclasses.replace(self, **changes)

  def replace_options(self, **changes) -> "Config":
    """A copy with some mode, model, dataset or schedule options changed."""
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


def _previous(text: str) -> Dict[str, str]:
  """A previous run's flags.txt, its renamed flags under their new names
  (`aliases`)."""
  values = parse_flagfile(text)
  try:
    return aliases.translate(values)
  except UserError:
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

