"""Options: frozen dataclasses whose fields become command-line flags.

A field declared with `option(...)` carries what its flag needs: help text,
bounds, choices, the `--helpfull` group, and whether it changes what a
checkpoint means. The run-wide `Config` is such a dataclass, and so is each
component's own `Options` (a parallel mode's, a model's): the flag layer
(`experiments/flags.py`) defines one absl flag per field from it, and
`check` enforces the same declaration on a value built in code. So a flag's
default and bounds are written once, next to the field; adding a mode's
flag is adding one field; the library receives the dataclass instance,
never FLAGS.

Two components may declare the same option (async and ps share
`--max_staleness`); it is one flag, and both must declare it alike.

A switch whose best setting depends on where the run computes is declared
with `auto_option`: True, False or AUTO (`AutoBool`), decided by the run.
"""

import dataclasses
import math
from typing import Any, Iterable, List, Optional, Tuple

from dist_loop.core.errors import UserError

# The default of an option that has none: the dataclass field is required
# (and so is the flag, where the entry point marks it).
REQUIRED = dataclasses.MISSING
# The value of an `auto_option` that the run decides.
AUTO = "auto"
# The largest value of a float option (the usual `upper` of a rate, a norm or
# a factor without a natural one). The step computes in float32 (largest
# 3.4e38): a larger value overflows to inf there, and clipping's
# clip / max(norm, clip) is then inf / inf = NaN. 1e30 leaves room for its
# products with ordinary values, keeps its reciprocal a normal float32, and
# is far above any real setting. `check_value` also holds an option without
# an `upper` to it.
MAX_FLOAT = 1e30


class AutoBool:
  """The type of an `auto_option`: True, False or AUTO.

  Its flag is a boolean flag that also takes `auto`: `--name` is True,
  `--noname` False, `--name=auto|true|false` any of the three. AUTO is for
  a setting no one value suits on every machine; the run replaces it with
  True or False before any component reads it (`--jit_compile`:
  `dist_loop/parallel/modes/xla.py`).
  """

  NAMES = (AUTO, "true", "false")

  @staticmethod
  def valid(value) -> bool:
    return isinstance(value, bool) or value == AUTO


@dataclasses.dataclass(frozen=True)
class Spec:
  """One option, as the flag layer needs it."""

  name: str
  # bool, int, float, str (also for an optional string) or AutoBool.
  type: type
  default: Any  # None for a REQUIRED option.
  help: str
  lower: Optional[float] = None  # Inclusive bounds.
  upper: Optional[float] = None
  # A tuple of names, or a Registry (checked by name; extensions may add).
  choices: Any = None
  # Changing it on an existing workdir changes what a checkpoint means.
  layout: bool = False
  # An exclusive lower bound: the value must be greater (a rate, "> 0").
  above: Optional[float] = None
  # Where --helpfull lists it; None: the flag layer names the group.
  group: Optional[str] = None


def option(default, help: str, *, lower=None, upper=None, above=None,
           choices=None, layout: bool = False, group: Optional[str] = None):
  """A dataclass field that is also a flag. See `Spec` for the arguments;
  `default=REQUIRED` makes the field required."""
  metadata = {"help": help, "lower": lower, "upper": upper, "above": above,
              "choices": choices, "layout": layout, "group": group}
  if default is REQUIRED:
    return dataclasses.field(metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


def auto_option(help: str, *, layout: bool = False,
                group: Optional[str] = None):
  """A field that is True, False or AUTO (its default), and its flag: see
  `AutoBool`."""
  return dataclasses.field(default=AUTO, metadata={
      "help": help, "lower": None, "upper": None, "above": None,
      "choices": None, "layout": layout, "group": group, "type": AutoBool})


def specs(options_class) -> List[Spec]:
  """The `option` fields of a dataclass, in declaration order (other fields,
  such as Config's component options, are not flags)."""
  out = []
  for field in dataclasses.fields(options_class):
    meta = field.metadata
    if "help" not in meta:
      continue
    default = None if field.default is REQUIRED else field.default
    kind = meta.get("type") or (str if default is None else type(default))
    out.append(Spec(field.name, kind, default, meta["help"], meta["lower"],
                    meta["upper"], meta["choices"], meta["layout"],
                    meta.get("above"), meta.get("group")))
  return out


def choice_names(choices) -> List[str]:
  return list(choices.names()) if hasattr(choices, "names") else list(choices)


def show(bound) -> str:
  """A bound as a message shows it: integers in full, floats short."""
  return str(bound) if isinstance(bound, int) else f"{bound:g}"


def check_value(spec: Spec, value) -> None:
  """Checks one value against its option's bounds and choices.

  Raises:
    UserError: naming the flag, the bound and the value.
  """
  if spec.type is AutoBool and not AutoBool.valid(value):
    raise UserError(f"unknown --{spec.name}={value!r}; choose one of: "
                    f"{', '.join(AutoBool.NAMES)}")
  if value is None:
    return
  if spec.type is float and math.isnan(value):
    raise UserError(f"--{spec.name} must be a number, got nan")
  if spec.type is float and spec.upper is None and abs(value) > MAX_FLOAT:
    raise UserError(f"--{spec.name} must be <= {show(MAX_FLOAT)} in size, "
                    f"got {value}")
  if spec.lower is not None and value < spec.lower:
    raise UserError(f"--{spec.name} must be >= {show(spec.lower)}, got "
                    f"{value}")
  if spec.above is not None and not value > spec.above:
    raise UserError(f"--{spec.name} must be > {show(spec.above)}, got "
                    f"{value}")
  if spec.upper is not None and value > spec.upper:
    raise UserError(f"--{spec.name} must be <= {show(spec.upper)}, got "
                    f"{value}")
  if spec.choices is not None and value not in spec.choices:
    raise UserError(f"unknown --{spec.name}={value!r}; choose one of: "
                    f"{', '.join(choice_names(spec.choices))}")


def check(options) -> None:
  """Checks every option's bounds and choices. Raises UserError."""
  if options is None:
    return
  for spec in specs(type(options)):
    check_value(spec, getattr(options, spec.name))


def layout_fields(options) -> Tuple[str, ...]:
  if options is None:
    return ()
  return tuple(s.name for s in specs(type(options)) if s.layout)


def as_dict(options) -> dict:
  return {} if options is None else dataclasses.asdict(options)


def names(options_classes: Iterable[type]) -> List[str]:
  return [s.name for c in options_classes for s in specs(c)]
