"""Options: frozen dataclasses whose fields become command-line flags.

A component with settings of its own (each parallel mode) declares them as a
frozen dataclass of `option(...)` fields next to its code. The flag layer
(`experiments/flags.py`) defines one absl flag per field, with its help text,
bounds and choices, so adding a mode's flag is adding one field; the library
receives the dataclass instance inside `Config.mode_options`, never FLAGS.

Two components may declare the same option (async and ps share
`--max_staleness`); it is one flag, and both must declare it alike.
"""

import dataclasses
from typing import Any, Iterable, List, Optional, Tuple

from dist_loop.errors import UserError


@dataclasses.dataclass(frozen=True)
class Spec:
  """One option, as the flag layer needs it."""

  name: str
  type: type  # bool, int, float or str (str also for an optional string).
  default: Any
  help: str
  lower: Optional[float] = None
  upper: Optional[float] = None
  # A tuple of names, or a Registry (checked by name; extensions may add).
  choices: Any = None
  # Changing it on an existing workdir changes what a checkpoint means.
  layout: bool = False


def option(default, help: str, *, lower=None, upper=None, choices=None,
           layout: bool = False):
  """A dataclass field that is also a flag. See `Spec` for the arguments."""
  return dataclasses.field(default=default, metadata={
      "help": help, "lower": lower, "upper": upper, "choices": choices,
      "layout": layout})


def specs(options_class) -> List[Spec]:
  """The options of a dataclass of `option` fields, in declaration order."""
  out = []
  for field in dataclasses.fields(options_class):
    meta = field.metadata
    kind = str if field.default is None else type(field.default)
    out.append(Spec(field.name, kind, field.default, meta.get("help", ""),
                    meta.get("lower"), meta.get("upper"), meta.get("choices"),
                    meta.get("layout", False)))
  return out


def choice_names(choices) -> List[str]:
  return list(choices.names()) if hasattr(choices, "names") else list(choices)


def check(options) -> None:
  """Checks every option's bounds and choices. Raises UserError."""
  if options is None:
    return
  for spec in specs(type(options)):
    value = getattr(options, spec.name)
    if value is None:
      continue
    if spec.lower is not None and value < spec.lower:
      raise UserError(f"--{spec.name} must be >= {spec.lower:g}, got {value}")
    if spec.upper is not None and value > spec.upper:
      raise UserError(f"--{spec.name} must be <= {spec.upper:g}, got {value}")
    if spec.choices is not None and value not in spec.choices:
      raise UserError(f"unknown --{spec.name}={value!r}; choose one of: "
                      f"{', '.join(choice_names(spec.choices))}")


def layout_fields(options) -> Tuple[str, ...]:
  if options is None:
    return ()
  return tuple(s.name for s in specs(type(options)) if s.layout)


def as_dict(options) -> dict:
  return {} if options is None else dataclasses.asdict(options)


def names(options_classes: Iterable[type]) -> List[str]:
  return [s.name for c in options_classes for s in specs(c)]
