"""`--jit_compile`: every mode whose step is traced, compiled with XLA.

Each mode with `--jit_compile` equals the same mode without it to 1e-4
(XLA fuses and reorders float math, docs/modes.md#xla), crossed with the
precisions and the sync reductions; a resume equals an uninterrupted run
exactly with it on, dropout included; what cannot compile is refused at
parse time. The default, `auto` (`modes/xla.py`): the flag's values, the
rule on faked GPUs, and on CPU a run equal bit for bit to one without XLA,
whose checkpoint a run with XLA resumes.
"""

import logging
import random
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl import flags
from absl.testing import flagsaver

from conftest import checkpoint_variables, max_diff, run_main
from dist_loop import configure, train
from dist_loop.control import weights
from dist_loop.core.errors import UserError
from dist_loop.models import MODELS
from dist_loop.parallel.modes import xla
from dist_loop.parallel.modes.pipeline import PipelineTrainer, planner, timing
from dist_loop.parallel.modes.ps import PSTrainer
from dist_loop.runtime import devices
from dist_loop.runtime.cluster import Cluster
from experiments import flags as run_flags
from helpers import load_data, make_trainer, record_host_timing, variables

STEPS = 4
TOLERANCE = 1e-4
# Eager kernels round to bfloat16 between every two ops; an XLA fusion keeps
# float32 inside it. The runs then differ by bfloat16's rounding.
BFLOAT16_TOLERANCE = 2e-3


def _xla_functions(graph) -> int:
  """How many functions of `graph`'s library XLA must compile."""
  return sum(1 for f in graph.as_graph_def().library.function
             if f.attr["_XlaMustCompile"].b)


def _trained(config):
  """(initial, trained) weights of STEPS steps, and how many functions
  of the traced loops XLA compiled."""
  trainer = make_trainer(config)
  start = variables(trainer)
  trainer.train(STEPS)
  end = variables(trainer)
  traced = list(getattr(trainer, "_loops", {}).values()) + [  # Async's.
      w._step_fn for w in getattr(trainer, "workers", [])]  # pylint: disable=protected-access
  compiled = sum(_xla_functions(cf.graph) for fn in traced
                 for cf in fn._list_all_concrete_functions())  # pylint: disable=protected-access
  trainer.close()
  return start, end, compiled


def _equal_with_and_without(small_config, tmp_path, **flat):
  start, plain, none = _trained(small_config(
      workdir=str(tmp_path / "plain"), **flat))
  _, jit, compiled = _trained(small_config(
      workdir=str(tmp_path / "jit"), jit_compile=True, **flat))
  assert max_diff(plain, start) > 1e-2  # It trained.
  bfloat16 = flat.get("precision") == "mixed_bfloat16"
  assert max_diff(plain, jit) <= (BFLOAT16_TOLERANCE if bfloat16
                                  else TOLERANCE)
  return none, compiled


@pytest.mark.parametrize("flat", [
    # A ZeRO stage with a cast sum, accumulation, bfloat16.
    dict(shard="optimizer", allreduce_compression="bf16",
         grad_accum_steps=2, precision="mixed_bfloat16"),
    # A compressor with data-dependent shapes (top-k), outside XLA.
    dict(allreduce_compression="topk", precision="mixed_float16"),
], ids=["zero1_bf16", "topk_fp16"])
def test_sync_on_two_devices(small_config, tmp_path, flat):
  none, compiled = _equal_with_and_without(
      small_config, tmp_path, num_devices=2, **flat)
  assert none == 0
  assert compiled >= 2  # One computation per replica.


@pytest.mark.usefixtures("eager_costs")
def test_pipeline_per_chunk(small_config, tmp_path):
  none, compiled = _equal_with_and_without(
      small_config, tmp_path, mode="pipeline", num_devices=2, num_stages=2,
      num_microbatches=4, stage_split="explicit", split_points="2",
      pipeline_timing="never", precision="mixed_float16")
  assert none == 0
  assert compiled >= 2  # Each chunk's forward (and its gradient).


def test_the_pipeline_planner_times_the_compiled_chunks(small_config,
                                                        monkeypatch):
  # The plan is made from the costs of what will run: each timer the
  # planner runs (the layers alone, then the chunks alone and crowded)
  # compiles its chunks' F, and its backward is B, not I and W.
  timers = []

  class Recorded(timing.ChunkTimer):
    def durations(self):
      timers.append(self)
      return super().durations()

  monkeypatch.setattr(timing, "ChunkTimer", Recorded)
  config = configure.validate(small_config(
      mode="pipeline", num_devices=2, num_stages=2, num_microbatches=2,
      pipeline_schedule="1f1b", jit_compile=True,
      # The pipeline flagfiles' threads, with which uncompiled chunks are
      # also timed crowded (a core per device).
      intra_op_threads=1, inter_op_threads=2), Cluster())
  plan = planner.plan(config, load_data(config), devices.configure(2, "cpu"))
  # The layers; the chunks, alone only: crowded, the other device's copy
  # would read the variables on the first, which XLA cannot.
  assert len({id(t) for t in timers}) == 2
  assert all(len(t.devices) == 1 for t in timers)
  assert plan.chosen.costs.crowded == ()
  for timer in {id(t): t for t in timers}.values():
    chunks = len(timer.executor.chunks)
    assert {a.kind for a in timer.row} == {"F", "B"}
    graph = timer.step.get_concrete_function(*timer.inputs).graph
    assert _xla_functions(graph) >= chunks  # Each chunk's F, compiled.
  costs = plan.chosen.costs
  assert all(f > 0 for f in costs.forward)
  # A compiled chunk's backward is one action, timed as B.
  assert costs.input_grad == costs.backward
  assert all(b > 0 for b in costs.backward)
  assert set(costs.weight_grad) == {0.0}


def test_the_deterministic_planner_times_the_compiled_chunks_from_the_host(
    small_config, monkeypatch):
  # Op determinism refuses the timestamps: the planner times the same
  # compiled chunks from the host, each action a call of the chunk's
  # actions up to it, and times no layer eagerly.
  timers, eager = record_host_timing(monkeypatch)
  config = configure.validate(small_config(
      mode="pipeline", num_devices=2, num_stages=2, num_microbatches=2,
      pipeline_schedule="1f1b", jit_compile=True, deterministic=True,
      intra_op_threads=1, inter_op_threads=2), Cluster())  # As above.
  keras.utils.set_random_seed(config.seed)
  tf.config.experimental.enable_op_determinism()  # As train.run does.
  plan = planner.plan(config, load_data(config), devices.configure(2, "cpu"))
  assert eager == [0]  # Sizes only.
  assert len({id(t) for t in timers}) == 2  # The layers; the chunks.
  assert all(len(t.devices) == 1 for t in timers)  # Alone (as above).
  for timer in {id(t): t for t in timers}.values():
    chunks = range(len(timer.executor.chunks))
    # Each chunk's F, and its F then B (a compiled backward is whole),
    # each against the call before it (no action: the inputs' copies).
    assert set(timer.functions) == {(c, a) for c in chunks
                                    for a in ((), ("F",), ("F", "B"))}
    for (c, actions), fn in timer.functions.items():
      concrete, = fn._list_all_concrete_functions()  # pylint: disable=protected-access
      # The chunk's F compiled, in each call with an action.
      assert (_xla_functions(concrete.graph) > 0) == bool(actions)
  chosen = plan.chosen.costs
  assert chosen.input_grad == chosen.backward
  assert set(chosen.weight_grad) == {0.0}


def test_local_sgd(small_config, tmp_path):
  none, compiled = _equal_with_and_without(
      small_config, tmp_path, mode="local_sgd", num_devices=2, sync_every=2,
      precision="mixed_bfloat16")
  assert none == 0 and compiled >= 2


def test_async_with_one_worker(small_config, tmp_path):
  none, compiled = _equal_with_and_without(
      small_config, tmp_path, mode="async", async_workers=1,
      precision="mixed_float16")
  assert none == 0 and compiled == 1


def test_resumed_equals_uninterrupted_with_jit_and_dropout(small_config,
                                                          tmp_path):
  # Dropout's masks are drawn inside the compiled step from its seed
  # generators, whose state no checkpoint holds: each step's seeds come
  # from the step (training/seeds.py), so the resumed steps draw the same.
  common = dict(num_devices=2, jit_compile=True, shard="gradients",
                model="test_dropout_mlp", deterministic=True,
                checkpoint_every=2, eval_every=4, log_every=2,
                steps_per_loop=2, train_steps=4, optimizer="adam",
                learning_rate=0.01)
  whole = small_config(workdir=str(tmp_path / "whole"), **common)
  train.run(whole)
  cut = small_config(workdir=str(tmp_path / "cut"), **common)
  train.run(cut.replace(train_steps=2))
  train.run(cut)
  a, b = (weights.load_model(c).trainable_variables for c in (whole, cut))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv"])
def test_a_split_backward_is_refused_at_the_door(small_config, schedule):
  with pytest.raises(UserError, match=(
      f"--jit_compile cannot compile --pipeline_schedule={schedule}: .*"
      "use --pipeline_schedule=1f1b, gpipe or interleaved_1f1b, or drop "
      "--jit_compile")):
    configure.validate(small_config(
        mode="pipeline", num_devices=2, num_stages=2, num_microbatches=4,
        pipeline_schedule=schedule, model="deep_mlp", jit_compile=True),
                       Cluster())


def test_data_parallel_pipelines_are_refused_at_the_door(small_config):
  with pytest.raises(UserError, match=(
      "--jit_compile cannot compile 2 data-parallel pipelines "
      r"\(--num_devices=4 over --num_stages=2\): .*use --num_devices=2, or "
      "drop --jit_compile")):
    configure.validate(small_config(
        mode="pipeline", num_devices=4, num_stages=2, num_microbatches=2,
        jit_compile=True), Cluster())


@MODELS.register("test_dropout_mlp")
def _dropout_mlp(input_shape, num_classes):
  """Dropout's seed is non-trainable state, on one device."""
  del input_shape
  return [keras.layers.Dense(16, activation="relu", name="dense"),
          keras.layers.Dropout(0.1, name="dropout"),
          keras.layers.Dense(num_classes, name="logits")]


@pytest.mark.usefixtures("eager_costs")
def test_a_pipeline_with_non_trainable_state_is_refused(small_config):
  config = small_config(mode="pipeline", num_devices=2, num_stages=2,
                        num_microbatches=2, stage_split="explicit",
                        split_points="2", model="test_dropout_mlp",
                        jit_compile=True)
  with pytest.raises(UserError, match=(
      "--mode=pipeline --jit_compile: the model has non-trainable state "
      r"\(seed_generator.*\), which a compiled chunk cannot read from "
      "another device; drop --jit_compile, or use --mode=sync")):
    make_trainer(config)


def test_xla_is_one_function_call_per_call():
  """`step.xla` compiles what it is given, and a tensor is an argument."""
  from dist_loop.training import step  # pylint: disable=g-import-not-at-top

  @tf.function(autograph=False)
  def outer(x):
    return step.xla(lambda a, b: a * 2.0 + (0.0 if b is None else b), x,
                    None)

  graph = outer.get_concrete_function(tf.TensorSpec([2])).graph
  assert _xla_functions(graph) == 1
  assert outer(tf.constant([1.0, 2.0])).numpy().tolist() == [2.0, 4.0]


# -- --jit_compile=auto, the default --


@pytest.mark.parametrize("args, value", [
    ((), "auto"), (("--jit_compile=auto",), "auto"),
    (("--jit_compile",), True), (("--jit_compile=true",), True),
    (("--nojit_compile",), False), (("--jit_compile=false",), False)])
def test_the_flag_is_auto_true_or_false(args, value):
  def parsed(*argv):
    with flagsaver.flagsaver():
      flags.FLAGS.unparse_flags()
      flags.FLAGS(["train", "--workdir=/tmp/unused", *argv])
      return run_flags.to_config()

  config = parsed(*args)
  assert (config.jit_compile, type(config.jit_compile)) == (value,
                                                            type(value))
  # flags.txt's line reads back as the same value.
  line = next(l for l in config.to_flagfile().splitlines() if "jit" in l)
  assert parsed(line).jit_compile == config.jit_compile


def test_a_bad_value_is_one_line_naming_the_choices(tmp_path, small_config):
  code, out, err = run_main(f"--workdir={tmp_path / 'run'}",
                            "--jit_compile=maybe")
  assert (code, out) == (1, "")
  assert err == ("FATAL Flags parsing error: flag --jit_compile=maybe: "
                 "value should be one of <auto|true|false>\n")
  assert not (tmp_path / "run").exists()
  # absl raises a ValueError for a value given to the --noNAME form.
  code, out, err = run_main(f"--workdir={tmp_path / 'run'}",
                            "--nojit_compile=auto")
  assert (code, out) == (2, "")
  assert err == ("error: --nojit_compile=auto does not take an argument: "
                 "give a boolean flag as --NAME, --noNAME or --NAME=VALUE\n")
  assert not (tmp_path / "run").exists()
  with pytest.raises(UserError, match=(
      "^unknown --jit_compile='yes'; choose one of: auto, true, false$")):
    configure.validate(small_config(jit_compile="yes"), Cluster())


GPUS = [f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(4)]
PS_CLUSTER = Cluster({"chief": ["c:1"], "worker": ["a:1"], "ps": ["p:1"]},
                     "chief", 0)
PIPELINE = dict(mode="pipeline", num_stages=2, num_microbatches=4)


@pytest.mark.parametrize("flat, on_gpus, why", [
    (dict(num_devices=2), True, None),
    (dict(PIPELINE, num_devices=2), True, None),
    (dict(PIPELINE, num_devices=4), False,
     "--jit_compile cannot compile 2 data-parallel pipelines"),
    (dict(PIPELINE, num_devices=2, pipeline_schedule="zbv",
          model="deep_mlp"), False,
     "--jit_compile cannot compile --pipeline_schedule=zbv"),
    (dict(PIPELINE, num_devices=2, model="test_dropout_mlp"), False,
     "--mode=pipeline --jit_compile: the model has non-trainable state"),
    (dict(mode="ps"), True, None),
    (dict(mode="ps", model="test_dropout_mlp"), False,
     "--mode=ps --jit_compile runs the model on weights read from the PSs, "
     "and the model has non-trainable state"),
], ids=["sync", "pipeline", "pipeline_data_parallel", "pipeline_zbv",
        "pipeline_dropout", "ps", "ps_dropout"])
def test_auto_compiles_on_gpus_what_an_explicit_flag_may_compile(
    small_config, flat, on_gpus, why):
  """GPUs faked by their names (nothing runs on them): on where the mode
  can compile the run, off with the refusal an explicit --jit_compile
  gets; off on CPU whatever the mode."""
  cluster = PS_CLUSTER if flat.get("mode") == "ps" else Cluster()
  config = configure.validate(small_config(**flat), cluster)
  dataset = load_data(config)
  gpus = GPUS[:config.num_devices]
  seeds = random.getstate(), np.random.get_state()[1].tolist()
  resolved, line = xla.resolve(config, gpus, dataset, cluster)
  # A throwaway model's initialisers gave back the seeds they drew.
  assert (random.getstate(), np.random.get_state()[1].tolist()) == seeds
  assert resolved.jit_compile is on_gpus
  assert resolved == config.replace(jit_compile=on_gpus)
  if on_gpus:
    assert line == ("XLA: on (--jit_compile=auto on GPU; --nojit_compile "
                    "not to compile)")
  else:
    assert line.startswith(f"XLA: off (--jit_compile=auto on GPU, but "
                           f"{why}"), line
  names = devices.configure(config.num_devices, "cpu")
  assert xla.resolve(config, names, dataset, cluster) == (
      config.replace(jit_compile=False),
      "XLA: off (--jit_compile=auto on CPU; --jit_compile to compile)")
  # An explicit value passes as it is; where auto is off, --jit_compile is
  # refused with the same reason (a model's: once it is built).
  for value in (True, False):
    assert xla.resolve(config.replace(jit_compile=value), gpus, dataset,
                       cluster)[0].jit_compile is value
  if why and "non-trainable" not in why:
    with pytest.raises(UserError, match="^" + re.escape(why)):
      configure.validate(config.replace(jit_compile=True), cluster)


@pytest.mark.parametrize("trainer_class", [PipelineTrainer, PSTrainer])
def test_a_model_refusal_names_the_models_state(small_config, trainer_class):
  config = small_config(model="test_dropout_mlp")
  model = xla._throwaway_model(config, load_data(config))  # pylint: disable=protected-access
  why = trainer_class.xla_model_refusal(model)
  assert why == trainer_class.xla_state_refusal.format(
      variable=model.non_trainable_variables[0].path)
  plain = small_config()
  assert trainer_class.xla_model_refusal(
      xla._throwaway_model(plain, load_data(plain))) is None  # pylint: disable=protected-access


def test_on_cpu_the_default_run_is_the_run_without_xla(small_config,
                                                      tmp_path, caplog):
  """Bit for bit; and a checkpoint written with XLA resumes without it."""
  common = dict(train_steps=4, steps_per_loop=2, log_every=2,
                eval_every=4, checkpoint_every=2, optimizer="adam",
                learning_rate=0.01)
  caplog.set_level(logging.INFO, logger="absl")
  runs = {}
  for name, flat in (("auto", {}), ("off", dict(jit_compile=False))):
    runs[name] = small_config(workdir=str(tmp_path / name), **common, **flat)
    assert train.run(runs[name])["jit_compile"] is False
  assert ("XLA: off (--jit_compile=auto on CPU; --jit_compile to "
          "compile)\n") in caplog.text
  assert "XLA: off (--nojit_compile)\n" in caplog.text
  auto, off = (checkpoint_variables(runs[n]) for n in ("auto", "off"))
  for a, b in zip(auto, off):
    np.testing.assert_array_equal(a, b)
  with open(tmp_path / "auto" / "flags.txt") as f:
    assert "--jit_compile=auto\n" in f.read()  # As given; decided at start.

  resumed = small_config(workdir=str(tmp_path / "resumed"), **common)
  assert train.run(resumed.replace(train_steps=2, jit_compile=True))[
      "jit_compile"] is True
  caplog.clear()
  assert train.run(resumed)["jit_compile"] is False
  assert ("changed since the checkpoint: --train_steps: 2 -> 4; "
          "--jit_compile: True -> auto\n") in caplog.text
  assert max_diff(checkpoint_variables(resumed), auto) <= TOLERANCE
