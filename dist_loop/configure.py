"""Building a valid `Config`: the checks that need the registries.

`Config` (config.py) is the lowest layer and knows no registry; this module
sits above the registries of modes, models, datasets and optimizers and
checks names against them, then asks the chosen mode for its own rules.
The flag layer and `run` both call `validate`, so a bad combination fails at
parse time, before any work.
"""

import dataclasses
from typing import Any, Dict

from dist_loop import cluster as cluster_lib
from dist_loop import data, models, modes, optim
from dist_loop.config import Config
from dist_loop.errors import UserError

_RUN_FIELDS = tuple(f.name for f in dataclasses.fields(Config)
                    if f.name != "mode_options")


def make_config(**fields: Any) -> Config:
  """A Config from flat `name=value` pairs, as flags give them.

  Run-wide names go to `Config`; the chosen mode's options go to its
  options dataclass. An unknown name, or an option of another mode, is a
  `UserError`. The result is not validated yet (see `validate`).
  """
  mode = fields.get("mode", "sync")
  options_class = modes.MODES.get(mode).Options
  option_names = {f.name for f in dataclasses.fields(options_class)}
  run = {k: v for k, v in fields.items() if k in _RUN_FIELDS}
  mode_fields = {k: v for k, v in fields.items() if k in option_names}
  unknown = sorted(set(fields) - set(run) - set(mode_fields))
  if unknown:
    owners = {name: m for m in modes.MODES.names()
              for name in _option_names(m)}
    for name in unknown:
      if name in owners:
        raise UserError(f"--{name} is an option of --mode={owners[name]}, not "
                        f"of --mode={mode}; drop it or change --mode")
    raise UserError(f"unknown setting {unknown[0]!r}")
  return Config(**run, mode_options=options_class(**mode_fields))


def validate(config: Config, cluster: cluster_lib.Cluster) -> Config:
  """Every rule of a run: run-wide, registered names, and the mode's own.

  Args:
    config: the run's configuration.
    cluster: this process's place in the cluster (read once, at start).

  Returns:
    `config`, with `mode_options` filled in with the mode's defaults if it
    was None.

  Raises:
    UserError: naming the fix.
  """
  trainer_class = modes.MODES.get(config.mode)
  if config.mode_options is None:
    config = config.replace(mode_options=trainer_class.Options())
  elif not isinstance(config.mode_options, trainer_class.Options):
    raise UserError(f"--mode={config.mode} takes options of type "
                    f"{trainer_class.Options.__name__}, got "
                    f"{type(config.mode_options).__name__}")
  config.validate()
  models.MODELS.get(config.model)
  data.DATASETS.get(config.dataset)
  optim.OPTIMIZERS.get(config.optimizer)
  if cluster.num_tasks > 1 and not trainer_class.multi_process:
    raise UserError(f"--mode={config.mode} runs in one process, but "
                    "TF_CONFIG describes a cluster; unset TF_CONFIG, or use "
                    "a multi-process mode (--mode=sync or --mode=ps)")
  trainer_class.check_capabilities(config)
  trainer_class.validate(config, cluster)
  return config


def _option_names(mode: str):
  return [f.name for f in dataclasses.fields(modes.MODES.get(mode).Options)]


def flat_defaults() -> Dict[str, Any]:
  """Every run-wide field's default (for tests and tools)."""
  return {f.name: f.default for f in dataclasses.fields(Config)
          if f.name != "mode_options"
          and f.default is not dataclasses.MISSING}
