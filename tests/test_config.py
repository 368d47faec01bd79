"""Config (run-wide fields) and configure (the checks that need the
registries). No TensorFlow work. Options: tests/test_options.py."""

import dataclasses

import pytest

from dist_loop import configure
from dist_loop.core import options as options_lib
from dist_loop.runtime.cluster import Cluster
from dist_loop.core.config import (COMPONENT_FIELDS, Config, check_divisible,
                              parse_flagfile)
from dist_loop.core.errors import UserError
from dist_loop.parallel.modes.pipeline.options import PipelineOptions
from dist_loop.parallel.modes.sync.options import SyncOptions

ONE_PROCESS = Cluster()
TWO_WORKERS = Cluster({"worker": ["a:1", "b:2"]}, "worker", 0)


# -- Config --


@pytest.mark.parametrize("change, message", [
    (dict(num_devices=0), "--num_devices must be >= 1, got 0"),
    (dict(eval_every=0), "--eval_every must be >= 1"),
    (dict(histogram_every=-1), "--histogram_every must be >= 0, got -1"),
    (dict(learning_rate=0.0), "--learning_rate must be > 0, got 0.0"),
    (dict(learning_rate=float("nan")), "--learning_rate must be a number, "
     "got nan"),
    (dict(max_loss=float("nan")), "--max_loss must be a number"),
    (dict(workdir=""), "--workdir is empty"),
    (dict(precision="fp8"), "unknown --precision='fp8'; choose one of"),
    (dict(nonfinite="ignore"), "unknown --nonfinite='ignore'"),
    (dict(max_rollbacks=-1), "--max_rollbacks must be >= 0"),
    (dict(collective_timeout_s=0.0), "--collective_timeout_s must be >= "
     "0.001, got 0.0"),
    (dict(seed=-1), "--seed must be >= 0, got -1"),
    (dict(seed=2**32), "--seed must be <= 4294967295, got 4294967296"),
    (dict(grace_period_s=float("inf")), "--grace_period_s must be <= 3600, "
     "got inf"),
    # Above float32's range the step computes inf (and clipping NaN).
    (dict(learning_rate=float("inf")), "--learning_rate must be <= 1e\\+30, "
     "got inf"),
    (dict(learning_rate=1e308), "--learning_rate must be <= 1e\\+30"),
    (dict(clip_global_norm=1e39), "--clip_global_norm must be <= 1e\\+30, "
     "got 1e\\+39"),
    (dict(weight_decay=float("inf")), "--weight_decay must be <= 1e\\+30"),
    (dict(max_loss=float("inf")), "--max_loss must be <= 1e\\+30"),
    (dict(diverged_loss_ratio=1e39), "--diverged_loss_ratio must be <= "
     "1e\\+30"),
    (dict(intra_op_threads=100000), "--intra_op_threads must be <= 1024"),
    (dict(train_steps=2**63), "--train_steps must be <= 2147483647"),
    (dict(global_batch_size=2**31), "--global_batch_size must be <= "
     "1048576"),
    (dict(profile_steps="3,1"), "1 <= FIRST <= LAST <= --train_steps=10"),
    (dict(profile_steps="a,b"), "for example --profile_steps=20,25"),
])
def test_each_run_wide_rule_names_the_flag(change, message):
  Config(workdir="w", train_steps=10).validate()  # The base is valid.
  with pytest.raises(UserError, match=message.replace("(", r"\(")):
    Config(workdir="w", train_steps=10).replace(**change).validate()


def test_values_at_the_bounds_are_valid():
  Config(workdir="w", seed=2**32 - 1, grace_period_s=3600.0,
         intra_op_threads=1024, inter_op_threads=1024,
         collective_timeout_s=86400.0, join_timeout_s=0.001,
         max_loss=1e30, learning_rate=1e-30).validate()
  Config(workdir="w", learning_rate=1e30, clip_global_norm=1e30,
         weight_decay=1e30, diverged_loss_ratio=1e30).validate()


def test_a_float_option_without_an_upper_bound_is_held_to_float32s():
  spec = options_lib.Spec("outer_learning_rate", float, 1.0, "h", above=0.0)
  options_lib.check_value(spec, options_lib.MAX_FLOAT)
  for value in (float("inf"), 1e39):
    with pytest.raises(UserError, match="--outer_learning_rate must be <= "
                       r"1e\+30 in size, got"):
      options_lib.check_value(spec, value)


def test_every_run_wide_field_is_declared_as_a_flag():
  """Help, group and type for each field but the component options;
  the layout fields are the ones a checkpoint depends on."""
  specs = options_lib.specs(Config)
  assert [s.name for s in specs] == [
      f.name for f in dataclasses.fields(Config)
      if f.name not in COMPONENT_FIELDS]
  for spec in specs:
    assert spec.help and spec.group, spec.name
  assert options_lib.layout_fields(Config(workdir="w")) == (
      "dataset", "model", "reducer", "num_devices", "global_batch_size",
      "grad_accum_steps")
  workdir = specs[0]
  assert (workdir.name, workdir.type, workdir.default) == ("workdir", str,
                                                           None)
  with pytest.raises(TypeError, match="workdir"):
    Config()  # pylint: disable=no-value-for-parameter


def test_profile_range():
  assert Config(workdir="w").profile_range is None
  assert Config(workdir="w", profile_steps="2,5").profile_range == (2, 5)


def test_the_flagfile_round_trips_and_leaves_out_unset_values():
  config = configure.make_config(workdir="w", mode="pipeline", num_stages=3,
                                 deterministic=True)
  text = config.to_flagfile()
  assert "--deterministic\n" in text and "--noallow_config_change\n" in text
  assert "--num_stages=3\n" in text and "data_dir" not in text
  assert "--allreduce_compression" not in text  # Not this run's mode.
  values = parse_flagfile(text)
  assert values["num_stages"] == "3" and values["deterministic"] == "True"
  assert values["allow_config_change"] == "False"
  assert parse_flagfile("# comment\n--flagfile=base.flags\n\n--seed=3\n") == {
      "seed": "3"}


def test_layout_changes_name_old_and_new_values():
  old = configure.make_config(workdir="w", mode="pipeline", num_devices=2)
  assert old.replace(train_steps=5, learning_rate=0.5).layout_changes(
      old.to_flagfile()) == []
  new = old.replace(num_devices=4).replace_options(num_stages=4)
  assert new.layout_changes(old.to_flagfile()) == [
      "--num_devices: 2 -> 4", "--num_stages: 2 -> 4"]
  # An option the old run did not have (another mode's) is not compared.
  sync = configure.make_config(workdir="w", mode="sync", num_devices=2)
  assert sync.layout_changes(old.to_flagfile()) == []


def test_replace_options():
  config = configure.make_config(workdir="w", mode="pipeline")
  assert config.replace_options(num_microbatches=8).mode_options == (
      PipelineOptions(num_microbatches=8))
  with pytest.raises(UserError, match="unknown options"):
    config.replace_options(jit=True)


def test_check_divisible_names_the_nearest_batch_sizes():
  check_divisible(64, 4)
  with pytest.raises(UserError, match="not divisible by 3 replicas; use 63 "
                     "or 66"):
    check_divisible(64, 3)
  with pytest.raises(UserError, match="use 3$"):
    check_divisible(2, 3)


# -- configure --


def test_make_config_routes_options_to_the_chosen_components():
  config = configure.make_config(workdir="w", mode="pipeline", num_stages=3,
                                 seed=4)
  assert config.seed == 4
  assert config.mode_options == PipelineOptions(num_stages=3)
  assert configure.make_config(workdir="w").mode_options == SyncOptions()


def test_an_option_of_a_component_not_chosen_is_one_clear_error():
  with pytest.raises(UserError, match="^--num_stages is an option of "
                     "--mode=pipeline, which this run does not use; drop "
                     "it$"):
    configure.make_config(workdir="w", mode="sync", num_stages=3)
  with pytest.raises(UserError, match="--max_staleness is an option of "
                     "--mode=async or --mode=ps"):
    configure.make_config(workdir="w", max_staleness=2)
  with pytest.raises(UserError, match="unknown setting 'bogus'"):
    configure.make_config(workdir="w", bogus=1)


def test_validate_fills_in_default_options_and_checks_their_type():
  config = configure.validate(Config(workdir="w"), ONE_PROCESS)
  assert config.mode_options == SyncOptions()
  with pytest.raises(UserError, match="--mode=sync takes options of type "
                     "SyncOptions, got PipelineOptions"):
    configure.validate(Config(workdir="w", mode_options=PipelineOptions()),
                       ONE_PROCESS)
  with pytest.raises(UserError, match="--dataset=digits takes no options"):
    configure.validate(Config(workdir="w", dataset_options=SyncOptions()),
                       ONE_PROCESS)


@pytest.mark.parametrize("fields, cluster, message", [
    (dict(optimizer="nope"), ONE_PROCESS, "unknown --optimizer='nope'"),
    (dict(mode="nope"), ONE_PROCESS, "unknown --mode='nope'"),
    (dict(model="nope"), ONE_PROCESS, "unknown --model='nope'"),
    (dict(mode="async", async_workers=-1), ONE_PROCESS,
     "--async_workers must be >= 0"),
    (dict(mode="async"), TWO_WORKERS, "--mode=async runs in one process"),
    (dict(mode="pipeline", num_devices=1), ONE_PROCESS, "--num_stages=2 "
     "needs 2 devices"),
    (dict(mode="sync", num_devices=3), ONE_PROCESS, "use 63 or 66"),
])
def test_validate_checks_names_options_and_the_modes_rules(fields, cluster,
                                                           message):
  with pytest.raises(UserError, match=message):
    configure.validate(configure.make_config(workdir="w", **fields), cluster)


def test_owners_lists_every_component_that_declares_an_option():
  owners = configure.owners()
  assert owners["num_stages"] == ["--mode=pipeline"]
  assert sorted(owners["max_staleness"]) == ["--mode=async", "--mode=ps"]
  assert set(configure.flat_defaults()) == {
      f.name for f in dataclasses.fields(Config)} - {
          "workdir", *COMPONENT_FIELDS}
