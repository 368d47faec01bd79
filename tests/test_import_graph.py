"""dist_loop's import graph: no cycle, no flags, and a Config at the bottom.

The graph is read from the source with `ast`, without importing anything, so
an import inside a function counts as much as one at the top of a module
(it runs later, but it still ties the two modules together). An edge goes
to the most specific module an import names: `from dist_loop.a import b` is
an edge to `dist_loop.a.b` if that is a module, else to `dist_loop.a`.
Python's implicit import of a module's parent packages is not an edge: a
package's `__init__` importing its own submodules is the package's business.
"""

import ast
import os
from typing import Dict, List, Optional, Set, Tuple

from conftest import REPO

PACKAGE = "dist_loop"
ROOT = os.path.join(REPO, PACKAGE)

# (importing module, line, imported module)
Edge = Tuple[str, int, str]


def _module_files() -> Dict[str, str]:
  """{dotted module name: path} of every module of the package."""
  out = {}
  for directory, _, files in os.walk(ROOT):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(directory, name)
      parts = os.path.relpath(path, REPO)[:-len(".py")].split(os.sep)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


MODULES = _module_files()


def _is_package(module: str) -> bool:
  return MODULES.get(module, "").endswith("__init__.py")


def _resolve(module: str, node: ast.ImportFrom) -> Optional[str]:
  """The absolute module an `ImportFrom` names (relative ones resolved)."""
  if not node.level:
    return node.module
  package = module if _is_package(module) else module.rpartition(".")[0]
  for _ in range(node.level - 1):
    package = package.rpartition(".")[0]
  return f"{package}.{node.module}" if node.module else package


def _internal(name: Optional[str]) -> bool:
  return name is not None and (name == PACKAGE
                               or name.startswith(PACKAGE + "."))


def _targets(module: str, node: ast.AST) -> List[str]:
  """The package's modules that one import statement names."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names if _internal(alias.name)]
  base = _resolve(module, node)
  if not _internal(base):
    return []
  return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES
          else base for alias in node.names]


def _parse(module: str) -> ast.Module:
  with open(MODULES[module], encoding="utf-8") as f:
    return ast.parse(f.read(), MODULES[module])


def edges() -> List[Edge]:
  """Every package-internal import, from anywhere in each module."""
  out = []
  for module in sorted(MODULES):
    for node in ast.walk(_parse(module)):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        for target in _targets(module, node):
          if target != module:
            out.append((module, node.lineno, target))
  return out


def find_cycle(graph: Dict[str, List[Edge]]) -> Optional[List[Edge]]:
  """One cycle of `graph` (module -> its out-edges) as its edges, or None."""
  state: Dict[str, int] = {}  # 1: on the current path, 2: finished.
  path: List[Edge] = []

  def visit(module: str) -> Optional[List[Edge]]:
    state[module] = 1
    for edge in graph.get(module, ()):
      target = edge[2]
      if state.get(target) == 1:
        start = next((i for i, e in enumerate(path) if e[0] == target),
                     len(path))
        return path[start:] + [edge]
      if target not in state:
        path.append(edge)
        found = visit(target)
        if found:
          return found
        path.pop()
    state[module] = 2
    return None

  for module in sorted(graph):
    if module not in state:
      found = visit(module)
      if found:
        return found
  return None


def _graph(all_edges: List[Edge]) -> Dict[str, List[Edge]]:
  graph: Dict[str, List[Edge]] = {}
  for edge in all_edges:
    graph.setdefault(edge[0], []).append(edge)
  return graph


def _describe(cycle: List[Edge]) -> str:
  return "\n".join(f"  {MODULES[a][len(REPO) + 1:]}:{line}: {a} -> {b}"
                   for a, line, b in cycle)


def _closure(graph: Dict[str, List[Edge]], start: str) -> Set[str]:
  seen, todo = set(), [start]
  while todo:
    for _, _, target in graph.get(todo.pop(), ()):
      if target not in seen:
        seen.add(target)
        todo.append(target)
  return seen


# -- the checker itself, on a graph with a known answer --

def test_find_cycle_returns_the_cycle_and_only_a_cycle():
  chain = [("a", 1, "b"), ("b", 2, "c"), ("c", 3, "d")]
  assert find_cycle(_graph(chain)) is None
  diamond = chain + [("a", 4, "d")]
  assert find_cycle(_graph(diamond)) is None
  cycle = find_cycle(_graph(chain + [("d", 5, "b")]))
  assert cycle == [("b", 2, "c"), ("c", 3, "d"), ("d", 5, "b")]


def test_edges_go_to_the_most_specific_module_and_count_function_imports():
  found = set((a, b) for a, _, b in edges())
  # `from dist_loop import configure` inside `dist_loop.make_config`.
  assert ("dist_loop", "dist_loop.configure") in found
  # `from dist_loop.core.errors import UserError`: the module, not a name in it.
  assert ("dist_loop.core.config", "dist_loop.core.errors") in found
  # `from dist_loop.data import Dataset`: a name, so the package.
  assert ("dist_loop.parallel.modes.base", "dist_loop.data") in found
  # No implicit edge from a submodule to its parent package.
  assert ("dist_loop.parallel.modes.base", "dist_loop.parallel.modes") not in found


# -- the rules --

def test_the_import_graph_has_no_cycle():
  cycle = find_cycle(_graph(edges()))
  assert cycle is None, "import cycle (file:line: importer -> imported):\n" + (
      _describe(cycle))


def test_nothing_in_the_library_reads_flags():
  offenders = []
  for module in sorted(MODULES):
    for node in ast.walk(_parse(module)):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [f"{node.module}.{a.name}" for a in node.names]
      elif isinstance(node, ast.Name) and node.id == "FLAGS":
        names = ["FLAGS"]
      elif isinstance(node, ast.Attribute) and node.attr == "FLAGS":
        names = ["FLAGS"]
      offenders += [f"{MODULES[module][len(REPO) + 1:]}:{node.lineno}: {n}"
                    for n in names
                    if n == "FLAGS" or n.startswith("absl.flags")]
  assert not offenders, "the library must not read flags:\n" + "\n".join(
      offenders)


# The folders of dist_loop and what each may import, besides itself. A
# module at the top (`dist_loop`, `configure`, `train`) may import anything.
# docs: WORKSPACE.md, "Import layers".
LAYERS = {
    "core": set(),
    "runtime": {"core"},
    "tasks": {"core", "runtime"},
    "training": {"core", "runtime", "tasks"},
    "models": {"core", "runtime", "training"},
    "data": {"core", "runtime", "tasks"},
    "parallel": {"core", "runtime", "tasks", "training", "models", "data"},
    "control": {"core", "runtime", "tasks", "training", "models", "data"},
}
TOP = {"dist_loop", "dist_loop.configure", "dist_loop.train"}


def _layer(module: str) -> Optional[str]:
  return None if module in TOP else module.split(".")[1]


def test_every_module_is_in_a_layer():
  strays = sorted(m for m in MODULES
                  if m not in TOP and _layer(m) not in LAYERS)
  assert not strays, ("modules outside the layer folders (put each in one, "
                      f"or add a layer to LAYERS): {strays}")


def test_imports_go_only_down_the_layers():
  upward = []
  for module, line, target in edges():
    layer, to = _layer(module), _layer(target)
    if layer is None or to == layer:
      continue
    if to is None or to not in LAYERS[layer]:
      upward.append(f"  {MODULES[module][len(REPO) + 1:]}:{line}: "
                    f"{module} ({layer}) -> {target} ({to or 'top'})")
  assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_layer_checker_catches_an_upward_import(monkeypatch):
  fake = [("dist_loop.runtime.lock", 1, "dist_loop.parallel.modes.base")]
  monkeypatch.setattr(__import__(__name__), "edges", lambda: fake)
  try:
    test_imports_go_only_down_the_layers()
  except AssertionError as e:
    assert "dist_loop.runtime.lock (runtime)" in str(e)
  else:
    raise AssertionError("an upward import passed the layer check")


def test_config_imports_nothing_above_it():
  graph = _graph(edges())
  direct = {b for _, _, b in graph.get("dist_loop.core.config", ())}
  # aliases: the renamed flags, names and values only.
  assert direct <= {"dist_loop.core.errors", "dist_loop.core.options",
                    "dist_loop.core.aliases"}, direct
  # Nor through them.
  assert _closure(graph, "dist_loop.core.config") <= {
      "dist_loop.core.errors", "dist_loop.core.options",
      "dist_loop.core.aliases"}


def test_config_reads_no_environment():
  tree = _parse("dist_loop.core.config")
  names = {n.attr if isinstance(n, ast.Attribute) else n.id
           for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Name))}
  assert not names & {"environ", "getenv"}


# -- the tests' own imports --

TESTS = os.path.join(REPO, "tests")
# Test files that still import from another test file; what they share
# belongs in tests/helpers.py. The list may only shrink.
IMPORTS_FROM_TEST_FILES = {
    ("test_sync_equivalence", "test_step"),
}


def test_no_new_test_file_imports_another():
  """Any import of one test file by another, at the top or in a function."""
  test_modules = {name[:-len(".py")] for name in os.listdir(TESTS)
                  if name.startswith("test_") and name.endswith(".py")}
  found = set()
  for module in sorted(test_modules):
    with open(os.path.join(TESTS, module + ".py"), encoding="utf-8") as f:
      tree = ast.parse(f.read(), module)
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module]
      else:
        continue
      found |= {(module, n.split(".")[0]) for n in names
                if n.split(".")[0] in test_modules}
  new = found - IMPORTS_FROM_TEST_FILES
  assert not new, ("test files that import from another test file; move "
                   "what they share into tests/helpers.py:\n" + "\n".join(
                       f"  tests/{a}.py imports {b}" for a, b in sorted(new)))
