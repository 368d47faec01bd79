"""The command-line contract: flag definitions, parse-time checks, Config.

Run-wide flags are defined here, one per `dist_loop.Config` field. The
flags of each mode, model and dataset are generated from the options
dataclass it declares (`Options`, see `dist_loop/options.py`), so a
component brings its own flags and this file does not change when one is
added (extensions register theirs on import, below). `--helpfull` lists
them per component ("options of --mode=pipeline").

The whole configuration is checked once, while absl parses: absl's own
checks (types, bounds, unknown flags), then `dist_loop.configure.validate`
(registered names, options of components the run does not use, every
mode's rules). So a bad command fails with one error before TensorFlow
starts any work. `to_config()` is the only bridge from FLAGS to the library.
"""

from typing import Any, Dict, Optional, Tuple

from absl import flags

from dist_loop import cluster as cluster_lib
from dist_loop import config as config_lib
from dist_loop import configure, data, models, modes, optim
from dist_loop import options as options_lib
from dist_loop.errors import UserError
from experiments import extensions  # pylint: disable=unused-import

FLAGS = flags.FLAGS


def _names(registry) -> str:
  return ", ".join(registry.names())


def _group(section: str) -> Dict[str, str]:
  """Lists the next flags under "run: SECTION" in --helpfull."""
  return {"module_name": f"run: {section}"}


_in = _group("the run")
flags.DEFINE_string("workdir", None, "Directory of the run: checkpoints, "
                    "TensorBoard events, flags.txt, summary.json. Rerunning "
                    "on the same workdir resumes.", **_in)
flags.DEFINE_string("mode", "sync", f"Parallel mode: {_names(modes.MODES)}.",
                    **_in)
flags.DEFINE_integer("train_steps", 1000, "Steps to train.", lower_bound=1,
                     **_in)
flags.DEFINE_integer("seed", 0, "Seed of initialisation and data order.",
                     **_in)
flags.DEFINE_bool("deterministic", False, "Deterministic kernels "
                  "(tf.config.experimental.enable_op_determinism).", **_in)
_in = _group("data and model")
flags.DEFINE_string("dataset", "digits",
                    f"Registered dataset: {_names(data.DATASETS)}.", **_in)
flags.DEFINE_string("data_dir", None, "Where file-based datasets (mnist.npz) "
                    "are read from; default: the Keras cache.", **_in)
flags.DEFINE_string("model", "cnn",
                    f"Registered model: {_names(models.MODELS)}.", **_in)
flags.DEFINE_integer("global_batch_size", 64, "Examples per step over all "
                     "replicas.", lower_bound=1, **_in)
flags.DEFINE_integer("eval_batch_size", 256, "Batch size of evaluation.",
                     lower_bound=1, **_in)
_in = _group("optimizer")
flags.DEFINE_string("optimizer", "adam",
                    f"Registered optimizer: {_names(optim.OPTIMIZERS)}.", **_in)
flags.DEFINE_float("learning_rate", 1e-3, "Learning rate (> 0).",
                   lower_bound=0.0, **_in)
_in = _group("devices")
flags.DEFINE_integer("num_devices", 1, "Devices: logical CPU devices on a "
                     "CPU-only machine, else the first N GPUs.", lower_bound=1,
                     **_in)
flags.DEFINE_enum("device_type", "auto", config_lib.DEVICE_TYPES,
                  "auto: GPUs if present, else CPU.", **_in)
flags.DEFINE_integer("intra_op_threads", 0, "Threads inside one op "
                     "(0: TensorFlow's default).", lower_bound=0, **_in)
flags.DEFINE_integer("inter_op_threads", 0, "Ops run concurrently "
                     "(0: TensorFlow's default).", lower_bound=0, **_in)
_in = _group("the loop")
flags.DEFINE_integer("steps_per_loop", 10, "Steps per tf.function call.",
                     lower_bound=1, **_in)
flags.DEFINE_integer("log_every", 50, "Steps between progress lines and "
                     "train summaries.", lower_bound=1, **_in)
flags.DEFINE_integer("eval_every", 200, "Steps between evaluations.",
                     lower_bound=1, **_in)
flags.DEFINE_integer("checkpoint_every", 200, "Steps between checkpoints.",
                     lower_bound=1, **_in)
flags.DEFINE_integer("max_checkpoints", 3, "Checkpoints kept.", lower_bound=1,
                     **_in)
flags.DEFINE_integer("histogram_every", 0, "Steps between weight and "
                     "gradient histograms (0: never).", lower_bound=0, **_in)
flags.DEFINE_string("profile_steps", "", "FIRST,LAST: write a TF profiler "
                    "trace of these steps to TensorBoard's Profile tab.",
                    **_in)
_in = _group("precision and accumulation")
flags.DEFINE_enum("precision", "float32", config_lib.PRECISIONS,
                  "Compute dtype policy; master weights stay float32. "
                  "mixed_float16 adds dynamic loss scaling.", **_in)
flags.DEFINE_integer("grad_accum_steps", 1, "Micro-steps of "
                     "--global_batch_size examples each, summed before one "
                     "all-reduce and one update (sync mode).",
                     lower_bound=1, **_in)
_in = _group("reliability")
flags.DEFINE_enum("nonfinite", "raise", config_lib.NONFINITE_POLICIES,
                  "On a NaN/Inf loss or gradient: raise (stop, naming the "
                  "step), skip (drop that update on every replica), or "
                  "rollback (restore the last checkpoint).", **_in)
flags.DEFINE_integer("max_rollbacks", 3, "With --nonfinite=rollback: give up "
                     "after this many.", lower_bound=0, **_in)
flags.DEFINE_float("max_loss", 0.0, "A step whose loss (in nats) is above "
                   "this is a divergence, handled like a non-finite step "
                   "(--nonfinite=raise or rollback); 0: no bound. A bound "
                   "of ~100x the first logged loss catches a run that blows "
                   "up.", lower_bound=0.0, **_in)
flags.DEFINE_integer("max_consecutive_skips", 50, "Stop the run once this "
                     "many steps in a row were skipped (--nonfinite=skip, or "
                     "float16 loss-scale overflows).", lower_bound=1, **_in)
flags.DEFINE_float("diverged_loss_ratio", 10.0, "Report the run as diverged "
                   "(a warning, summary.json, exit code 3) if its last "
                   "logged loss is this many times its first, or its "
                   "evaluation is non-finite; 0: never.", lower_bound=0.0,
                   **_in)
flags.DEFINE_float("grace_period_s", 30.0, "After SIGTERM, seconds to save a "
                   "checkpoint and exit.", lower_bound=0.1, **_in)
flags.DEFINE_bool("allow_config_change", False, "Resume a workdir even if "
                  "the model or device layout flags differ from flags.txt.",
                  **_in)
_in = _group("several processes (TF_CONFIG; see tools/launch.py)")
flags.DEFINE_float("collective_timeout_s", 120.0, "Multi-worker sync: a "
                   "collective that waits this long for a peer fails "
                   "(CommunicationOptions.timeout_seconds); ps: training "
                   "fails after this long without an applied update.",
                   lower_bound=0.001, **_in)
flags.DEFINE_float("join_timeout_s", 300.0, "Multi-process runs: joining "
                   "the cluster fails if a peer task has not come up after "
                   "this long.", lower_bound=0.001, **_in)

RUN_FLAGS: Tuple[str, ...] = tuple(configure.flat_defaults()) + ("workdir",)
# The option flags defined so far, by name.
_OPTION_FLAGS: Dict[str, options_lib.Spec] = {}


def define_component_flags() -> None:
  """Defines a flag for every option of every registered mode, model and
  dataset, once per name.

  Called at import, after the extensions registered theirs; call it again
  for a component registered later.

  Raises:
    ValueError: an option has the name of another flag, or two components
      declare one option differently (a bug in the component).
  """
  for name, owners in configure.owners().items():
    spec = _spec_of(name)
    if name in _OPTION_FLAGS:
      known = _OPTION_FLAGS[name]
      if (known.type, known.default) != (spec.type, spec.default):
        raise ValueError(f"option --{name} is declared differently by "
                         f"{', '.join(owners)}")
      continue
    if name in FLAGS:
      raise ValueError(f"option --{name} of {', '.join(owners)} has the name "
                       "of another flag; rename the option")
    _define(spec, f"options of {', '.join(owners)}")
    _OPTION_FLAGS[name] = spec


def _spec_of(name: str) -> options_lib.Spec:
  """The first declaration of option `name` among the components."""
  for _, registry, _ in configure.COMPONENTS:
    for component in registry.names():
      cls = configure.options_class(registry, component)
      for spec in options_lib.specs(cls) if cls else ():
        if spec.name == name:
          return spec
  raise KeyError(name)


def _define(spec: options_lib.Spec, group: str) -> None:
  """One absl flag for `spec`, listed under `group` in --helpfull.
  Registry choices are checked with the config, as registered names are."""
  common = dict(module_name=group)
  if spec.type is bool:
    flags.DEFINE_bool(spec.name, spec.default, spec.help, **common)
  elif spec.type in (int, float):
    define = flags.DEFINE_integer if spec.type is int else flags.DEFINE_float
    define(spec.name, spec.default, spec.help, lower_bound=spec.lower,
           upper_bound=spec.upper, **common)
  elif isinstance(spec.choices, (tuple, list)):
    flags.DEFINE_enum(spec.name, spec.default, list(spec.choices), spec.help,
                      **common)
  else:
    choices = ("" if spec.choices is None else " (registered: "
               f"{', '.join(options_lib.choice_names(spec.choices))})")
    flags.DEFINE_string(spec.name, spec.default, spec.help + choices, **common)


define_component_flags()


def _values(overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
  """The run-wide flags, the options of the chosen components, and any
  other option the user set (which `configure.make_config` refuses)."""
  overrides = overrides or {}

  def value(name):
    return overrides[name] if name in overrides else FLAGS[name].value

  fields = {n: value(n) for n in RUN_FLAGS}
  chosen = {f"--{selector}={fields[selector]}"
            for selector, _, _ in configure.COMPONENTS}
  for name, owners in configure.owners().items():
    if chosen & set(owners) or FLAGS[name].present:
      fields[name] = value(name)
  return fields


# The last configuration validated: its key (values, cluster) and Config.
_validated: Dict[str, Any] = {}


def _validate(values: Dict[str, Any]) -> config_lib.Config:
  """`configure.validate` of `values`, once per distinct command line."""
  key = (values, cluster_lib.current())
  if _validated.get("key") != key:
    config = configure.validate(configure.make_config(**values), key[1])
    _validated.update(key=key, config=config)
  return _validated["config"]


@flags.multi_flags_validator(["mode", "num_devices", "global_batch_size"])
def _config_is_valid(values):
  """Every rule of the config, mode-specific ones included, at parse time.

  The rules live with the code they protect (`Config.validate`,
  `dist_loop.configure` and each mode's `Trainer.validate`); this only runs
  them. absl runs validators once all flags are parsed, so the other
  fields are read as they are. The error is raised as IllegalFlagValueError,
  not ValidationError: absl would prefix it with the values of the three
  flags above, which are rarely the ones at fault.
  """
  try:
    _validate(_values(values))
  except UserError as e:
    raise flags.IllegalFlagValueError(str(e)) from None
  return True


def to_config() -> config_lib.Config:
  """The parsed flags as a validated Config (raises UserError if invalid)."""
  return _validate(_values())


def to_flagfile() -> str:
  """The resolved run flags in flagfile format, for WORKDIR/flags.txt:
  the run-wide flags and the chosen components' options."""
  return to_config().to_flagfile()
