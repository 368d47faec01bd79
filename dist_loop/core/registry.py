"""Name registries: how a new model, dataset, optimizer or mode plugs in.

A research extension adds one file that calls `REGISTRY.register("name")` on a
builder, and selects it with a flag. Unknown names are a `UserError` that lists
what is registered.
"""

from typing import Callable, Dict, Generic, List, TypeVar

from dist_loop.core.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
  """A name -> builder map for one kind of extension point."""

  def __init__(self, kind: str, flag: str):
    self.kind = kind
    self.flag = flag
    self._entries: Dict[str, T] = {}

  def register(self, name: str) -> Callable[[T], T]:
    """Decorator: `@MODELS.register("mlp")` above a builder."""

    def add(entry: T) -> T:
      if name in self._entries and self._entries[name] is not entry:
        raise ValueError(f"{self.kind} {name!r} is registered twice")
      self._entries[name] = entry
      return entry

    return add

  def get(self, name: str) -> T:
    if name not in self._entries:
      raise UserError(f"unknown --{self.flag}={name!r}; registered "
                      f"{self.kind}s: {', '.join(self.names())}")
    return self._entries[name]

  def names(self) -> List[str]:
    return sorted(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries
