"""Building a valid `Config`: the checks that need the registries.

`Config` (config.py) is the lowest layer and knows no registry; this module
sits above the registries of modes, models, datasets and optimizers and
checks names against them, then asks the chosen mode for its own rules.
The flag layer and `run` both call `validate`, so a bad combination fails at
parse time, before any work.

A registered mode, model or dataset may declare `Options`, a dataclass of
`option(...)` fields (`dist_loop/core/options.py`): its flags. `COMPONENTS` says
which registry fills which `Config` field.
"""

import dataclasses
from typing import Any, Dict, List, Tuple

from dist_loop import data, models
from dist_loop.core import options as options_lib
from dist_loop.core.config import COMPONENT_FIELDS, Config
from dist_loop.core.errors import UserError
from dist_loop.core.registry import Registry
from dist_loop.parallel import modes
from dist_loop.runtime import cluster as cluster_lib
from dist_loop.training import optim

# (selector field, registry, Config field of its options)
COMPONENTS: Tuple[Tuple[str, Registry, str], ...] = (
    ("mode", modes.MODES, "mode_options"),
    ("model", models.MODELS, "model_options"),
    ("dataset", data.DATASETS, "dataset_options"),
)

_RUN_FIELDS = tuple(f.name for f in dataclasses.fields(Config)
                    if f.name not in COMPONENT_FIELDS)


def options_class(registry: Registry, name: str):
  """The options dataclass a registered entry declares, or None."""
  return getattr(registry.get(name), "Options", None)


def owners() -> Dict[str, List[str]]:
  """{option name: ["--mode=ps", "--model=transformer", ...]} over every
  registered component that declares it."""
  out: Dict[str, List[str]] = {}
  for selector, registry, _ in COMPONENTS:
    for name in registry.names():
      cls = options_class(registry, name)
      for spec in options_lib.specs(cls) if cls else ():
        out.setdefault(spec.name, []).append(f"--{selector}={name}")
  return out


def make_config(**fields: Any) -> Config:
  """A Config from flat `name=value` pairs, as flags give them.

  Run-wide names go to `Config`; the options of the chosen mode, model and
  dataset go to their options dataclasses. An unknown name, or an option of
  a component that was not chosen, is a `UserError`. The result is not
  validated yet (see `validate`).
  """
  chosen = {}
  taken = set(k for k in fields if k in _RUN_FIELDS)
  defaults = {f.name: f.default for f in dataclasses.fields(Config)}
  for selector, registry, field in COMPONENTS:
    cls = options_class(registry, fields.get(selector, defaults[selector]))
    if cls is None:
      continue
    names = {f.name for f in dataclasses.fields(cls)}
    chosen[field] = cls(**{k: v for k, v in fields.items() if k in names})
    taken |= names & set(fields)
  unknown = sorted(set(fields) - taken)
  if unknown:
    who = owners()
    for name in unknown:
      if name in who:
        raise UserError(f"--{name} is an option of {' or '.join(who[name])}, "
                        "which this run does not use; drop it")
    raise UserError(f"unknown setting {unknown[0]!r}: not a field of Config, "
                    "nor an option of the chosen mode, model or dataset")
  return Config(**{k: v for k, v in fields.items() if k in _RUN_FIELDS},
                **chosen)


def validate(config: Config, cluster: cluster_lib.Cluster) -> Config:
  """Every rule of a run: run-wide, registered names, and the mode's own.

  Args:
    config: the run's configuration.
    cluster: this process's place in the cluster (read once, at start).

  Returns:
    `config`, with each chosen component's options filled in with their
    defaults where they were None.

  Raises:
    UserError: naming the fix.
  """
  trainer_class = modes.MODES.get(config.mode)
  optim.OPTIMIZERS.get(config.optimizer)
  for selector, registry, field in COMPONENTS:
    cls = options_class(registry, getattr(config, selector))
    value = getattr(config, field)
    if cls is None:
      if value is not None:
        raise UserError(f"--{selector}={getattr(config, selector)} takes no "
                        "options")
    elif value is None:
      config = config.replace(**{field: cls()})
    elif not isinstance(value, cls):
      raise UserError(f"--{selector}={getattr(config, selector)} takes "
                      f"options of type {cls.__name__}, got "
                      f"{type(value).__name__}")
  config.validate()
  if cluster.num_tasks > 1 and not trainer_class.multi_process:
    raise UserError(f"--mode={config.mode} runs in one process, but "
                    "TF_CONFIG describes a cluster; unset TF_CONFIG, or use "
                    "a multi-process mode (--mode=sync or --mode=ps)")
  trainer_class.check_capabilities(config)
  trainer_class.validate(config, cluster)
  return config


def flat_defaults() -> Dict[str, Any]:
  """Every run-wide field's default (for tests and tools)."""
  return {f.name: f.default for f in dataclasses.fields(Config)
          if f.name not in COMPONENT_FIELDS
          and f.default is not dataclasses.MISSING}
