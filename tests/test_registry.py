"""Registries: how an extension plugs in by name."""

import pytest

from dist_loop.core.errors import UserError
from dist_loop.core.registry import Registry


def test_register_and_get():
  registry = Registry("widget", "widget_kind")

  @registry.register("b")
  def b():
    return "b"

  a = registry.register("a")(lambda: "a")
  assert registry.get("b") is b and registry.get("a") is a
  assert registry.names() == ["a", "b"]
  assert "a" in registry and "c" not in registry


def test_an_unknown_name_lists_what_is_registered():
  registry = Registry("widget", "widget_kind")
  registry.register("one")(object())
  registry.register("two")(object())
  with pytest.raises(UserError, match=r"^unknown --widget_kind='three'; "
                     "registered widgets: one, two$"):
    registry.get("three")


def test_a_name_registers_one_entry():
  registry = Registry("widget", "widget_kind")
  entry = object()
  registry.register("x")(entry)
  registry.register("x")(entry)  # The same entry again: a module reloaded.
  with pytest.raises(ValueError, match="widget 'x' is registered twice"):
    registry.register("x")(object())
  assert registry.get("x") is entry
