"""The command-line contract: flag definitions, parse-time checks, Config.

Every flag is generated from a dataclass of `option(...)` fields
(`dist_loop/core/options.py`): the run-wide flags from `dist_loop.Config`, and
each mode's, model's, dataset's, schedule's and reducer's from the `Options`
it declares. The old names of renamed flags (`dist_loop/core/aliases.py`)
are defined here, for one release. A flag's
type, default, help, bounds, choices and `--helpfull` group are what the
field declares, so they are written once; this file does not change when a
field or a component is added (the user's modules, `--user_modules`,
register theirs when the entry point imports them, before this module). `--helpfull` lists the run-wide flags by section ("run: the loop")
and each component's under its name ("options of --mode=pipeline").

The whole configuration is checked once, while absl parses: absl's own
checks (types, the declared bounds, unknown flags), then
`dist_loop.configure.validate` (registered names, options of components the
run does not use, every mode's rules) against this process's cluster
(`cluster()`, `TF_CONFIG` read once). So a bad command fails with one error
before TensorFlow starts any work. `to_config()` is the only bridge from
FLAGS to the library.
"""

import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

from absl import flags

from dist_loop import configure
from dist_loop.core import aliases
from dist_loop.core import config as config_lib
from dist_loop.core import options as options_lib
from dist_loop.core.errors import UserError
from dist_loop.runtime import cluster as cluster_lib
from dist_loop.training import optim
from experiments import user_modules

FLAGS = flags.FLAGS

# Run-wide fields whose value is a registered name: their help lists the
# names; `configure.validate` checks them.
_REGISTERED = {**{selector: registry
                  for selector, registry, _ in configure.COMPONENTS},
               "optimizer": optim.OPTIMIZERS}


class _NumberParser(flags.FloatParser):
  """absl's float parser, refusing NaN (which compares false with any bound,
  so absl lets it through) and taking an exclusive lower bound (`above`)."""

  def __init__(self, spec: options_lib.Spec):
    super().__init__(spec.lower, spec.upper)
    self.above = spec.above

  def is_outside_bounds(self, val: float) -> bool:
    return (math.isnan(val) or super().is_outside_bounds(val)
            or (self.above is not None and not val > self.above))


def _numeric_parser(spec: options_lib.Spec) -> flags.ArgumentParser:
  """The parser of an int or float option. Its `syntactic_help` names the
  bounds in numbers: absl shows it in --helpfull and in the one-line error
  ("flag --seed=-1: -1 is not an integer in the range [0, 4294967295]")."""
  if spec.type is int:
    parser, kind = flags.IntegerParser(spec.lower, spec.upper), "an integer"
  else:
    parser, kind = _NumberParser(spec), "a number"
  lower = None if spec.lower is None else options_lib.show(spec.lower)
  upper = None if spec.upper is None else options_lib.show(spec.upper)
  if lower is not None and upper is not None:
    bounds = [f"in the range [{lower}, {upper}]"]
  else:
    bounds = [f">= {lower}"] if lower is not None else []
    if spec.above is not None:
      bounds.append(f"> {options_lib.show(spec.above)}")
    if upper is not None:
      bounds.append(f"<= {upper}")
  parser.syntactic_help = " ".join([kind, " and ".join(bounds)]).strip()
  return parser


class _AutoBoolParser(flags.BooleanParser):
  """absl's boolean parser, also taking `auto` (`options.AutoBool`)."""

  syntactic_help = "|".join(options_lib.AutoBool.NAMES)

  def parse(self, argument):
    if (isinstance(argument, str)
        and argument.strip().lower() == options_lib.AUTO):
      return options_lib.AUTO
    try:
      return super().parse(argument)
    except (TypeError, ValueError):
      raise ValueError(f"value should be one of <{self.syntactic_help}>"
                       ) from None

  def flag_type(self) -> str:
    return "bool or auto"


class _AutoBoolFlag(flags.Flag):
  """The flag of an `auto_option`: boolean to absl, which gives it 'true'
  for a bare `--name` and 'false' for `--noname`, so both keep working
  beside `--name=auto|true|false`."""

  def __init__(self, spec: options_lib.Spec):
    super().__init__(_AutoBoolParser(), None, spec.name, spec.default,
                     spec.help, boolean=True)

  def _serialize(self, value) -> str:
    if value == options_lib.AUTO:
      return f"--{self.name}={options_lib.AUTO}"
    return super()._serialize(value)

  def _get_parsed_value_as_string(self, value):
    if value == options_lib.AUTO:
      return repr(options_lib.AUTO)
    return super()._get_parsed_value_as_string(value)


def _define(spec: options_lib.Spec, group: str) -> None:
  """One absl flag for `spec`, listed under `group` in --helpfull.
  Registry choices are checked with the config, as registered names are."""
  common = dict(module_name=group)
  if spec.type is options_lib.AutoBool:
    flags.DEFINE_flag(_AutoBoolFlag(spec), **common)
  elif spec.type is bool:
    flags.DEFINE_bool(spec.name, spec.default, spec.help, **common)
  elif spec.type in (int, float):
    flags.DEFINE(_numeric_parser(spec), spec.name, spec.default, spec.help,
                 serializer=flags.ArgumentSerializer(), **common)
  elif isinstance(spec.choices, (tuple, list)):
    flags.DEFINE_enum(spec.name, spec.default, list(spec.choices), spec.help,
                      **common)
  else:
    choices = ("" if spec.choices is None else " (registered: "
               f"{', '.join(options_lib.choice_names(spec.choices))})")
    flags.DEFINE_string(spec.name, spec.default, spec.help + choices, **common)


def _define_run_flags() -> Tuple[str, ...]:
  """A flag for every run-wide `Config` field. Returns their names."""
  names = []
  for spec in options_lib.specs(config_lib.Config):
    if spec.name in _REGISTERED:
      spec = dataclasses.replace(spec, choices=_REGISTERED[spec.name])
    _define(spec, f"run: {spec.group}")
    names.append(spec.name)
  return tuple(names)


RUN_FLAGS: Tuple[str, ...] = _define_run_flags()

# The old selectors of sync's reduction, read as `--reducer` and its options
# (`dist_loop/core/aliases.py`); the only flags not generated from a field.
_DEPRECATED = "deprecated, for one release"
flags.DEFINE_string(
    "allreduce_compression", None, "none|fp16|bf16|powersgd|topk|NAME: "
    "the old name of --reducer=exact|cast "
    "(with --cast_dtype)|powersgd|topk|NAME.", module_name=_DEPRECATED)
flags.DEFINE_enum(
    "shard", None, ["none", "optimizer", "gradients", "weights"],
    "The old name of --reducer=zero1|zero2|"
    "zero3 (with --zero_wire_dtype from --allreduce_compression).",
    module_name=_DEPRECATED)
# The option flags defined so far, by name.
_OPTION_FLAGS: Dict[str, options_lib.Spec] = {}


def define_component_flags() -> None:
  """Defines a flag for every option of every registered mode, model and
  dataset, once per name.

  Called at import, after the user's modules registered theirs; call it
  again for a component registered later.

  Raises:
    ValueError: an option has the name of another flag, or two components
      declare one option differently (a bug in the component).
  """
  for name, owners in configure.owners().items():
    spec = _spec_of(name)
    if name in _OPTION_FLAGS and name in FLAGS:  # (A test may drop flags.)
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


define_component_flags()


def _values(overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
  """The run-wide flags, the options of the chosen components, and any
  other option the user set (which `configure.make_config` refuses). An
  option of a component registered after the flags were made (imported by
  a program, not by `--user_modules`) has no flag: its default applies."""
  overrides = overrides or {}

  def value(name):
    return overrides[name] if name in overrides else FLAGS[name].value

  fields = {n: value(n) for n in RUN_FLAGS}
  chosen = {f"--{selector}={fields[selector]}"
            for selector, _, _ in configure.COMPONENTS}
  for name, owners in configure.owners().items():
    if name in FLAGS and (chosen & set(owners) or FLAGS[name].present):
      fields[name] = value(name)
  for name in aliases.OLD_SELECTORS:
    if name in overrides or FLAGS[name].present:
      fields[name] = value(name)
  return fields


# This process's cluster, once read.
_cluster: Dict[str, cluster_lib.Cluster] = {}


def cluster() -> cluster_lib.Cluster:
  """This process's place in a cluster: `TF_CONFIG`, read at the first call
  and kept, so that the flags are checked against the cluster the run then
  joins (the entry point passes this one to `dist_loop.run`).

  Raises:
    UserError: TF_CONFIG is malformed.
  """
  if "cluster" not in _cluster:
    _cluster["cluster"] = cluster_lib.current()
  return _cluster["cluster"]


def use_cluster(value: Optional[cluster_lib.Cluster]) -> None:
  """Sets what `cluster()` returns; None: read TF_CONFIG at its next call
  (for tests, which parse several command lines in one process)."""
  _cluster.clear()
  if value is not None:
    _cluster["cluster"] = value


# The last configuration validated: its key (values, cluster) and Config.
_validated: Dict[str, Any] = {}


def _validate(values: Dict[str, Any]) -> config_lib.Config:
  """`configure.validate` of `values`, once per distinct command line."""
  key = (values, cluster())
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
  `--user_modules` (paths absolute), the run-wide flags and the chosen
  components' options."""
  modules = user_modules.recorded(FLAGS.user_modules)
  return ((f"--user_modules={','.join(modules)}\n" if modules else "")
          + to_config().to_flagfile())
