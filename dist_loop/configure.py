"""Building a valid `Config`: the checks that need the registries.

`Config` (config.py) is the lowest layer and knows no registry; this module
sits above the registries of modes, models, datasets, schedules, reducers
and optimizers and checks names against them, then asks the chosen mode for
its own rules.
The flag layer and `run` both call `validate`, so a bad combination fails at
parse time, before any work. `--jit_compile=auto` stays `auto` here: whether
it compiles is decided as the trainer is built, where the devices and the
model are known (`dist_loop/parallel/modes/xla.py`).

A registered mode, model, dataset, schedule or reducer may declare
`Options`, a dataclass of `option(...)` fields (`dist_loop/core/options.py`):
its flags. `COMPONENTS` says which registry fills which `Config` field.
The old names of renamed flags are translated first (`core/aliases.py`).
"""

import dataclasses
import os
from typing import Any, Dict, List, Tuple

from dist_loop import data, models
from dist_loop.core import aliases
from dist_loop.core import options as options_lib
from dist_loop.core.config import COMPONENT_FIELDS, Config
from dist_loop.core.errors import UserError
from dist_loop.core.registry import Registry
from dist_loop.parallel import modes
from dist_loop.parallel.reducers import REDUCERS
from dist_loop.runtime import cluster as cluster_lib
from dist_loop.runtime import devices
from dist_loop.training import optim, schedules

# (selector field, registry, Config field of its options)
COMPONENTS: Tuple[Tuple[str, Registry, str], ...] = (
    ("mode", modes.MODES, "mode_options"),
    ("model", models.MODELS, "model_options"),
    ("dataset", data.DATASETS, "dataset_options"),
    ("lr_schedule", schedules.SCHEDULES, "schedule_options"),
    ("reducer", REDUCERS, "reducer_options"),
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

  Run-wide names go to `Config`; the options of the chosen components go
  to their options dataclasses. An old flag name is read as its new one
  (`aliases`). An unknown name, or an option of a component that was not
  chosen, is a `UserError`. The result is not validated yet (see
  `validate`).
  """
  fields = aliases.translate(fields)
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
                    "nor an option of the chosen mode, model, dataset, "
                    "schedule or reducer")
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
  _check_reducer(config, trainer_class)
  config.validate()
  devices.check_thread_variables(os.environ)
  check_fit(config.model, config.dataset)
  schedules.check(config)
  if cluster.num_tasks > 1 and not trainer_class.multi_process:
    raise UserError(f"--mode={config.mode} runs in one process, but "
                    "TF_CONFIG describes a cluster; unset TF_CONFIG, or use "
                    "a multi-process mode (--mode=sync, local_sgd or ps)")
  trainer_class.check_capabilities(config)
  trainer_class.validate(config, cluster)
  why = config.jit_compile is True and trainer_class.xla_refusal(config,
                                                                  cluster)
  if why:
    raise UserError(why)
  return config


def _check_reducer(config: Config, trainer_class) -> None:
  """A mode that reduces no gradients (`takes_reducer` false) takes only
  the default reducer, at its defaults: anything else would be ignored."""
  if getattr(trainer_class, "takes_reducer", False):
    return
  default = Config(workdir=config.workdir)
  if (config.reducer != default.reducer
      or config.reducer_options != options_class(
          REDUCERS, default.reducer)()):
    raise UserError(f"--mode={config.mode} does not use a reducer; drop "
                    f"--reducer and its options, or use --mode=sync")


def fits(model: str, dataset: str) -> bool:
  """Whether the registered model takes what the registered dataset gives,
  by their declarations (`models.takes`, `data.gives`); what a dataset does
  not declare is not held against it."""
  return _misfit(model, dataset) is None


def _misfit(model: str, dataset: str, got=None):
  """What of the model's declaration the dataset does not give (`got`: what
  it gives; None: what it declares), or None."""
  want = models.takes(model)
  if got is None:
    got = data.gives(dataset, models.image_size_for(model))
  if None not in (want.task, got.task) and want.task != got.task:
    return f"the {want.task} task, but --dataset={dataset} poses {got.task}"
  if None not in (want.dtype, got.dtype) and want.dtype != got.dtype:
    return f"{want.dtype} inputs, but --dataset={dataset} gives {got.dtype}"
  if None not in (want.rank, got.rank) and want.rank != got.rank:
    return (f"examples of rank {want.rank}, but --dataset={dataset} gives "
            f"rank {got.rank}")
  return None


def check_fit(model: str, dataset: str, got=None) -> None:
  """Refuses a model and a dataset that do not fit, naming what does.

  Args:
    model: a registered model.
    dataset: a registered dataset.
    got: what the loaded dataset gives (`data.given`), for the checks its
      loader's declaration left open; None: its declaration only.

  Raises:
    UserError: one line: what the model takes, what the dataset gives, and
      the registered pairs that fit.
  """
  misfit = _misfit(model, dataset, got)
  if misfit is None:
    return
  # Another model by task and dtype: the rank of loaded data depends on
  # the image size the model asked for.
  fixes = [f"--model={m} with this dataset" for m in models.MODELS.names()
           if m != model and _misfit(m, dataset, got and got._replace(
               rank=None)) is None]
  fixes += [f"--dataset={d} with this model" for d in data.DATASETS.names()
            if fits(model, d) and d != dataset]
  raise UserError(f"--model={model} takes {misfit}; use "
                  f"{' or '.join(fixes) or 'another pair'}")


def flat_defaults() -> Dict[str, Any]:
  """Every run-wide field's default (for tests and tools)."""
  return {f.name: f.default for f in dataclasses.fields(Config)
          if f.name not in COMPONENT_FIELDS
          and f.default is not dataclasses.MISSING}
