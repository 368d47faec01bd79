"""Config (run-wide fields), options (a component's own), configure (the
checks that need the registries). No TensorFlow work."""

import dataclasses
from typing import Optional

import pytest

from dist_loop import configure
from dist_loop import options as options_lib
from dist_loop.cluster import Cluster
from dist_loop.config import Config, check_divisible, parse_flagfile
from dist_loop.errors import UserError
from dist_loop.modes.pipeline.options import PipelineOptions
from dist_loop.modes.sync.options import SyncOptions
from dist_loop.registry import Registry

ONE_PROCESS = Cluster()
TWO_WORKERS = Cluster({"worker": ["a:1", "b:2"]}, "worker", 0)


# -- Config --


@pytest.mark.parametrize("change, message", [
    (dict(num_devices=0), "--num_devices must be at least 1, got 0"),
    (dict(eval_every=0), "--eval_every must be at least 1"),
    (dict(histogram_every=-1), "--histogram_every must be >= 0, got -1"),
    (dict(learning_rate=0.0), "--learning_rate must be > 0"),
    (dict(workdir=""), "--workdir is empty"),
    (dict(precision="fp8"), "unknown --precision='fp8'; choose one of"),
    (dict(nonfinite="ignore"), "unknown --nonfinite='ignore'"),
    (dict(max_rollbacks=-1), "--max_rollbacks must be >= 0"),
    (dict(collective_timeout_s=0.0), "--collective_timeout_s must be > 0"),
    (dict(profile_steps="3,1"), "1 <= FIRST <= LAST <= --train_steps=10"),
    (dict(profile_steps="a,b"), "for example --profile_steps=20,25"),
])
def test_each_run_wide_rule_names_the_flag(change, message):
  Config(workdir="w", train_steps=10).validate()  # The base is valid.
  with pytest.raises(UserError, match=message.replace("(", r"\(")):
    Config(workdir="w", train_steps=10).replace(**change).validate()


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


# -- options --


@dataclasses.dataclass(frozen=True)
class Toy:
  size: int = options_lib.option(4, "Size.", lower=1, upper=8, layout=True)
  kind: str = options_lib.option("a", "Kind.", choices=("a", "b"))
  name: Optional[str] = options_lib.option(None, "Name.")
  fast: bool = options_lib.option(False, "Fast.")


def test_specs_describe_each_option_in_order():
  specs = options_lib.specs(Toy)
  assert [(s.name, s.type) for s in specs] == [
      ("size", int), ("kind", str), ("name", str), ("fast", bool)]
  assert (specs[0].lower, specs[0].upper, specs[0].layout) == (1, 8, True)
  assert options_lib.layout_fields(Toy()) == ("size",)
  assert options_lib.as_dict(None) == {}
  assert options_lib.names([Toy]) == ["size", "kind", "name", "fast"]


@pytest.mark.parametrize("value, message", [
    (dict(size=0), "--size must be >= 1, got 0"),
    (dict(size=9), "--size must be <= 8, got 9"),
    (dict(kind="c"), "unknown --kind='c'; choose one of: a, b"),
])
def test_check_refuses_values_out_of_bounds_or_choices(value, message):
  options_lib.check(Toy(size=8, kind="b", name="x"))
  options_lib.check(None)
  with pytest.raises(UserError, match=message):
    options_lib.check(Toy(**value))


def test_registry_choices_are_checked_by_name():
  registry = Registry("policy", "policy")
  registry.register("one")(object())

  @dataclasses.dataclass(frozen=True)
  class WithRegistry:
    policy: str = options_lib.option("one", "Policy.", choices=registry)

  options_lib.check(WithRegistry())
  with pytest.raises(UserError, match="unknown --policy='two'; choose one "
                     "of: one"):
    options_lib.check(WithRegistry("two"))


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
    configure.validate(Config(workdir="w", dataset_options=Toy()),
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
          "workdir", "mode_options", "model_options", "dataset_options"}
