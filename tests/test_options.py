"""Options (dist_loop/core/options.py): what a field declares, and `check`."""

import dataclasses
from typing import Optional

import pytest

from dist_loop.core import options as options_lib
from dist_loop.core.errors import UserError
from dist_loop.core.registry import Registry


@dataclasses.dataclass(frozen=True)
class Toy:
  size: int = options_lib.option(4, "Size.", lower=1, upper=8, layout=True)
  kind: str = options_lib.option("a", "Kind.", choices=("a", "b"))
  name: Optional[str] = options_lib.option(None, "Name.")
  fast: bool = options_lib.option(False, "Fast.")
  rate: float = options_lib.option(0.5, "Rate.", above=0.0, upper=1.0,
                                   group="rates")


@dataclasses.dataclass(frozen=True)
class WithRequired:
  where: str = options_lib.option(options_lib.REQUIRED, "Where.")
  plain: int = 3  # Not an option: not a flag.


def test_specs_describe_each_option_in_order():
  specs = options_lib.specs(Toy)
  assert [(s.name, s.type) for s in specs] == [
      ("size", int), ("kind", str), ("name", str), ("fast", bool),
      ("rate", float)]
  assert (specs[0].lower, specs[0].upper, specs[0].layout) == (1, 8, True)
  assert (specs[4].above, specs[4].upper, specs[4].group) == (0.0, 1.0,
                                                              "rates")
  assert specs[0].group is None
  assert options_lib.layout_fields(Toy()) == ("size",)
  assert options_lib.as_dict(None) == {}
  assert options_lib.names([Toy]) == ["size", "kind", "name", "fast", "rate"]


def test_a_required_option_has_no_default_and_plain_fields_are_not_options():
  assert options_lib.specs(WithRequired) == [
      options_lib.Spec("where", str, None, "Where.")]
  with pytest.raises(TypeError, match="where"):
    WithRequired()  # pylint: disable=no-value-for-parameter
  assert WithRequired("x").plain == 3


@pytest.mark.parametrize("value, message", [
    (dict(size=0), "--size must be >= 1, got 0"),
    (dict(size=9), "--size must be <= 8, got 9"),
    (dict(kind="c"), "unknown --kind='c'; choose one of: a, b"),
    (dict(rate=0.0), "--rate must be > 0, got 0.0"),
    (dict(rate=1.5), "--rate must be <= 1, got 1.5"),
    (dict(rate=float("nan")), "--rate must be a number, got nan"),
])
def test_check_refuses_values_out_of_bounds_or_choices(value, message):
  options_lib.check(Toy(size=8, kind="b", name="x", rate=1.0))
  options_lib.check(Toy(size=1, rate=1e-300))
  options_lib.check(None)
  with pytest.raises(UserError, match=message):
    options_lib.check(Toy(**value))


def test_bounds_show_integers_in_full():
  assert options_lib.show(2**32 - 1) == "4294967295"
  assert options_lib.show(3600.0) == "3600"
  assert options_lib.show(0.001) == "0.001"


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
