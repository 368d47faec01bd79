"""`--jit_compile=auto`: whether a run compiles with XLA, decided once, as
its trainer is built.

`resolve` is the rule, and the only code that reads `auto`: every trainer
is built from its result (`build_trainer`), so a mode sees True or False,
as with an explicit `--jit_compile` or `--nojit_compile`. auto is on where
the run trains on GPUs and its mode can compile this run; off otherwise.

- **Off on CPU.** XLA on a CPU is not faster for every model: on this
  project's CPU measurements it sped up the MLP and the Transformer but
  slowed down the seed CNN of `make train`, and each trace compiles for
  seconds more (docs/modes.md#xla---jit_compile has the numbers).
- **On on GPUs.** It is what Keras's own `jit_compile="auto"` gives a
  model that compiles when `fit` runs on a GPU without a strategy. Keras
  turns it off under any `tf.distribute` strategy, where `fit` would compile
  the whole step, collectives included; a mode here compiles a replica's
  own math only and keeps the collectives outside (`step.xla`), so a
  strategy is no reason to leave it off.
- **Off where the mode cannot compile this run**, by the very rules that
  refuse an explicit `--jit_compile`: the mode's `xla_refusal` of the
  configuration, and its `xla_model_refusal` of the model (asked of a
  throwaway build, made only for a mode that has such a rule). auto never
  turns a run that trains without XLA into an error.

It is decided here and not in `configure.validate` because the devices are
known only once configured, and a model's state only once it is built for
the loaded dataset's shapes.
"""

import random
from typing import List, Tuple

import numpy as np
import tensorflow as tf

from dist_loop import models
from dist_loop.core.config import Config
from dist_loop.parallel.modes.base import MODES


def resolve(config: Config, devices: List[str], dataset,
            cluster) -> Tuple[Config, str]:
  """`config` with `--jit_compile=auto` made True or False, and the run's
  line saying which and why (an explicit value passes unchanged).

  Args:
    config: the run's validated configuration.
    devices: the devices the run trains on (`devices.configure`).
    dataset: the loaded dataset (a throwaway model is built for it).
    cluster: this process's place in the cluster.
  """
  if isinstance(config.jit_compile, bool):
    return config, ("XLA: on (--jit_compile)" if config.jit_compile
                    else "XLA: off (--nojit_compile)")
  if not _on_gpus(devices):
    return config.replace(jit_compile=False), (
        "XLA: off (--jit_compile=auto on CPU; --jit_compile to compile)")
  trainer_class = MODES.get(config.mode)
  why = trainer_class.xla_refusal(config, cluster)
  if why is None and trainer_class.xla_state_refusal is not None:
    try:
      why = trainer_class.xla_model_refusal(_throwaway_model(config,
                                                             dataset))
    except Exception as e:  # pylint: disable=broad-except
      why = (f"its model did not build apart to be checked ({e!r:.200}); "
             "--jit_compile to compile")
  if why:
    return config.replace(jit_compile=False), (
        f"XLA: off (--jit_compile=auto on GPU, but {why})")
  return config.replace(jit_compile=True), (
      "XLA: on (--jit_compile=auto on GPU; --nojit_compile not to compile)")


def _on_gpus(devices: List[str]) -> bool:
  return bool(devices) and all(
      tf.DeviceSpec.from_string(d).device_type == "GPU" for d in devices)


def _throwaway_model(config: Config, dataset):
  """The run's model, built in a graph of its own: its variables exist but
  hold nothing on any device. The seeds its initialisers drew are given
  back, so the run's own model is the one it would be without this one."""
  state = random.getstate(), np.random.get_state()
  try:
    with tf.Graph().as_default():
      return models.build_for(config, dataset)
  finally:
    random.setstate(state[0])
    np.random.set_state(state[1])
