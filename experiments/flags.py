"""The command-line contract: flag definitions, parse-time checks, Config.

Run-wide flags are defined here, one per `dist_loop.Config` field. The
flags of each mode, model and dataset are generated from the options
dataclass it declares (`Options`, see `dist_loop/options.py`), so a
component brings its own flags and this file does not change when one is
added. Checks a flag can do alone (enums,
bounds, registered names) and those that span flags run while absl parses,
so a bad command fails before TensorFlow starts any work. `to_config()` is
the only bridge from FLAGS to the library.
"""

from typing import Dict, List

from absl import flags

from dist_loop import cluster as cluster_lib
from dist_loop import config as config_lib
from dist_loop import configure, data, models, modes, optim
from dist_loop import options as options_lib
from dist_loop.errors import UserError

FLAGS = flags.FLAGS

# -- run --
flags.DEFINE_string("workdir", None, "Directory of the run: checkpoints, "
                    "TensorBoard events, flags.txt, summary.json. Rerunning "
                    "on the same workdir resumes.")
flags.DEFINE_enum("mode", "sync", modes.MODES.names(), "Parallel mode.")
flags.DEFINE_integer("train_steps", 1000, "Steps to train (applied updates).",
                     lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of initialisation and data order.")
flags.DEFINE_bool("deterministic", False, "Deterministic kernels "
                  "(tf.config.experimental.enable_op_determinism).")
# -- data and model --
flags.DEFINE_string("dataset", "digits", "Registered dataset: "
                    + ", ".join(data.DATASETS.names()) + ".")
flags.DEFINE_string("data_dir", None, "Where file-based datasets (mnist.npz) "
                    "are read from; default: the Keras cache.")
flags.DEFINE_string("model", "cnn", "Registered model: "
                    + ", ".join(models.MODELS.names()) + ".")
flags.DEFINE_integer("global_batch_size", 64, "Examples per step over all "
                     "replicas.", lower_bound=1)
flags.DEFINE_integer("eval_batch_size", 256, "Batch size of evaluation.",
                     lower_bound=1)
# -- optimizer --
flags.DEFINE_string("optimizer", "adam", "Registered optimizer: "
                    + ", ".join(optim.OPTIMIZERS.names()) + ".")
flags.DEFINE_float("learning_rate", 1e-3, "Learning rate.", lower_bound=0.0)
# -- devices --
flags.DEFINE_integer("num_devices", 1, "Devices: logical CPU devices on a "
                     "CPU-only machine, else the first N GPUs.", lower_bound=1)
flags.DEFINE_enum("device_type", "auto", config_lib.DEVICE_TYPES,
                  "auto: GPUs if present, else CPU.")
flags.DEFINE_integer("intra_op_threads", 0, "Threads inside one op "
                     "(0: TensorFlow's default).", lower_bound=0)
flags.DEFINE_integer("inter_op_threads", 0, "Ops run concurrently "
                     "(0: TensorFlow's default).", lower_bound=0)
# -- the loop --
flags.DEFINE_integer("steps_per_loop", 10, "Steps per tf.function call.",
                     lower_bound=1)
flags.DEFINE_integer("log_every", 50, "Steps between progress lines and "
                     "train summaries.", lower_bound=1)
flags.DEFINE_integer("eval_every", 200, "Steps between evaluations.",
                     lower_bound=1)
flags.DEFINE_integer("checkpoint_every", 200, "Steps between checkpoints.",
                     lower_bound=1)
flags.DEFINE_integer("max_checkpoints", 3, "Checkpoints kept.", lower_bound=1)
flags.DEFINE_integer("histogram_every", 0, "Steps between weight and "
                     "gradient histograms (0: never).", lower_bound=0)
flags.DEFINE_string("profile_steps", "", "FIRST,LAST: write a TF profiler "
                    "trace of these steps to TensorBoard's Profile tab.")
# -- precision and accumulation --
flags.DEFINE_enum("precision", "float32", config_lib.PRECISIONS,
                  "Compute dtype policy; master weights stay float32. "
                  "mixed_float16 adds dynamic loss scaling.")
flags.DEFINE_integer("grad_accum_steps", 1, "Micro-steps of "
                     "--global_batch_size examples each, summed before one "
                     "all-reduce and one update (sync mode).", lower_bound=1)
# -- reliability --
flags.DEFINE_enum("nonfinite", "raise", config_lib.NONFINITE_POLICIES,
                  "On a NaN/Inf loss or gradient: raise (stop, naming the "
                  "step), skip (drop that update on every replica), or "
                  "rollback (restore the last checkpoint).")
flags.DEFINE_integer("max_rollbacks", 3, "With --nonfinite=rollback: give up "
                     "after this many.", lower_bound=0)
flags.DEFINE_float("grace_period_s", 30.0, "After SIGTERM, seconds to save a "
                   "checkpoint and exit.", lower_bound=0.1)
flags.DEFINE_bool("allow_config_change", False, "Resume a workdir even if "
                  "the model or device layout flags differ from flags.txt.")
# -- multiple processes (TF_CONFIG; see tools/launch.py) --
flags.DEFINE_float("collective_timeout_s", 120.0, "Multi-worker sync: a "
                   "collective that waits this long for a peer fails "
                   "(CommunicationOptions.timeout_seconds); ps: training "
                   "fails after this long without an applied update.",
                   lower_bound=0.001)

_RUN_FLAGS = [n for n in configure.flat_defaults()] + ["workdir"]


def _registered(registry):
  def check(name):
    if name not in registry:
      raise flags.ValidationError(
          f"unknown {registry.kind} {name!r}; registered: "
          f"{', '.join(registry.names())}")
    return True
  return check


flags.register_validator("dataset", _registered(data.DATASETS))
flags.register_validator("model", _registered(models.MODELS))
flags.register_validator("optimizer", _registered(optim.OPTIMIZERS))


def define_component_flags() -> Dict[str, List[str]]:
  """Defines a flag for every option of every registered mode, model and
  dataset (once per name), and returns {flag: ["--mode=ps", ...]}.

  Called at import for the built-in components, and again before the
  flags are read, after extensions may have registered theirs.
  """
  who = configure.owners()
  for selector, registry, _ in configure.COMPONENTS:
    for name in registry.names():
      cls = configure.options_class(registry, name)
      for spec in options_lib.specs(cls) if cls else ():
        if spec.name not in FLAGS:
          _define(spec)
  return who


def _define(spec: options_lib.Spec) -> None:
  help_text = spec.help
  kwargs = {}
  if spec.type is bool:
    flags.DEFINE_bool(spec.name, spec.default, help_text)
    return
  if spec.type in (int, float):
    kwargs = {"lower_bound": spec.lower, "upper_bound": spec.upper}
    define = flags.DEFINE_integer if spec.type is int else flags.DEFINE_float
    define(spec.name, spec.default, help_text, **kwargs)
    return
  if isinstance(spec.choices, (tuple, list)):
    flags.DEFINE_enum(spec.name, spec.default, list(spec.choices), help_text)
    return
  flags.DEFINE_string(spec.name, spec.default, help_text)
  if spec.choices is not None:
    flags.register_validator(spec.name, _registered(spec.choices))


define_component_flags()


def _values(overrides=None) -> Dict[str, object]:
  """The run-wide flags and the chosen components' options; an error for a
  flag the user set that belongs to a component this run does not use."""
  overrides = overrides or {}
  who = define_component_flags()

  def value(name):
    return overrides.get(name, FLAGS[name].value)

  chosen = {f"--{selector}={value(selector)}"
            for selector, _, _ in configure.COMPONENTS}
  fields = {n: value(n) for n in _RUN_FLAGS}
  for name, taken_by in who.items():
    if chosen & set(taken_by):
      fields[name] = value(name)
    elif FLAGS[name].present:
      raise UserError(f"--{name} is an option of {' or '.join(taken_by)}, "
                      "which this run does not use; drop it")
  return fields


@flags.multi_flags_validator(["mode", "num_devices", "global_batch_size"])
def _config_is_valid(values):
  """Every rule that spans flags, mode-specific ones included, at parse time.

  The rules live with the code they protect (`Config.validate`,
  `dist_loop.configure` and each mode's `Trainer.validate`); this only runs
  them. absl runs validators once all flags are parsed, so the other
  fields are read as they are.
  """
  try:
    configure.validate(configure.make_config(**_values(values)),
                       cluster_lib.current())
  except UserError as e:
    raise flags.ValidationError(str(e)) from None
  return True


def to_config() -> config_lib.Config:
  """The parsed flags as a validated Config (raises UserError if invalid)."""
  return configure.validate(configure.make_config(**_values()),
                            cluster_lib.current())


def to_flagfile() -> str:
  """The resolved run flags in flagfile format, for WORKDIR/flags.txt:
  the run-wide flags and the chosen mode's."""
  return to_config().to_flagfile()
