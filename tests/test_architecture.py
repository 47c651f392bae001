"""The package's shape: wings (a package per concern) whose imports point one way, no import
circles, and modules that can be read in one sitting.

The import graph is read from the source (every `import`/`from ... import`, at module level or
inside a function, and `importlib.import_module("...")` calls), so a lazy import cannot hide an
arrow. Each check also runs once on the package with a back-import added, and must fail there.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "bertjax"

# The wings from the bottom up: a module may import its own wing and the wings below it.
LAYERS = ("paths", "models", "data", "parallel", "hf", "inference", "finetune", "config",
          "checkpoints", "resilience", "reproduction", "training", "tools", "cli", "__main__")
MAX_LINES = 500
MAX_ENTRY_LINES = 150  # the CLI's entry module
ENTRY = "bertjax.cli"


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_package() -> dict[str, str]:
  """Module name -> source of every module of bertjax/."""
  return {_module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _package_of(module: str, is_package: bool) -> list[str]:
  parts = module.split(".")
  return parts if is_package else parts[:-1]


def imports(module: str, source: str, modules: set[str], is_package: bool) -> set[str]:
  """The bertjax modules `module` imports (resolved to modules, not names inside them)."""
  found = set()

  def resolve(name: str) -> str | None:
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name or None

  for node in ast.walk(ast.parse(source)):
    names: list[str] = []
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = _package_of(module, is_package)[:len(_package_of(module, is_package))
                                                 - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
      names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
               for alias in node.names]
    elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str)
          and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module",
                                                                             "__import__")):
      names = [node.args[0].value]
    for name in names:
      if name == "bertjax" or name.startswith("bertjax."):
        target = resolve(name)
        if target and target != module:
          found.add(target)
  return found


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
  modules = set(sources)
  packages = {m for m in modules if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()}
  return {m: imports(m, s, modules, m in packages) for m, s in sources.items()}


def wing(module: str) -> str | None:
  """bertjax.training.loop -> "training"; bertjax.paths -> "paths"; bertjax -> None."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else None


def back_imports(graph: dict[str, set[str]]) -> list[str]:
  """Each import that runs against the declared direction (or into or out of a module in no
  declared wing)."""
  offences = []
  for module, targets in sorted(graph.items()):
    for target in sorted(targets):
      here, there = wing(module), wing(target)
      if here not in LAYERS or there not in LAYERS:
        offences.append(f"{module} -> {target}: {here or there!r} is in no declared wing")
      elif LAYERS.index(there) > LAYERS.index(here):
        offences.append(f"{module} ({here}) imports {target} ({there}), a higher wing")
  return offences


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_every_module_lives_in_a_declared_wing():
  loose = [m for m in read_package() if m != "bertjax" and wing(m) not in LAYERS]
  assert not loose, f"modules outside the declared wings {LAYERS}: {loose}"


def test_imports_point_down_the_wings_function_level_included():
  offences = back_imports(import_graph(read_package()))
  assert not offences, "imports against the wings' direction:\n" + "\n".join(offences)


def test_no_import_circles():
  found = circles(import_graph(read_package()))
  assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("importer, imported", [
    ("bertjax.models.bert", "bertjax.training.loop"),      # a model reaching for the loop
    ("bertjax.training.trainer", "bertjax.tools.bench"),    # the core reaching for the tools
    ("bertjax.data.pipeline", "bertjax.checkpoints.train_state"),
])
def test_the_checks_fail_on_an_added_back_import(importer, imported):
  """A back-import added inside a function (where it is easiest to hide) is reported, and so
  is the circle it closes where the imported module already depends on the importer."""
  sources = read_package()
  sources[importer] += f"\n\ndef _hidden():\n  import {imported}\n  return {imported}\n"
  graph = import_graph(sources)
  assert any(f"{importer} (" in line and imported in line for line in back_imports(graph))
  reaches_back = importer in _reachable(graph, imported)
  assert bool(circles(graph)) == reaches_back


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    for w in graph.get(todo.pop(), ()):
      if w not in seen:
        seen.add(w)
        todo.append(w)
  return seen


def test_the_graph_sees_lazy_imports():
  """Not vacuous: the CLI's lazy imports of the tools are arrows in the graph."""
  graph = import_graph(read_package())
  assert {"bertjax.tools.aot", "bertjax.tools.bench"} <= set().union(
      *(targets for module, targets in graph.items() if module.startswith(ENTRY)))
  assert len(graph) > 40


def test_modules_fit_in_one_sitting():
  long = {m: s.count("\n") for m, s in read_package().items() if s.count("\n") > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines: {long}"
  entry = read_package()[ENTRY].count("\n")
  assert entry < MAX_ENTRY_LINES, f"{ENTRY} has {entry} lines (at most {MAX_ENTRY_LINES - 1})"


def test_importing_the_core_and_the_cli_loads_no_tools():
  """`bertjax --help` and library users pay for no measurement tooling: importing the training
  entry points and the CLI loads nothing of bertjax.tools."""
  code = ("import json, sys\n"
          "import bertjax.training.trainer, bertjax.training.loop, bertjax.cli\n"
          "print(json.dumps(sorted(m for m in sys.modules if m.startswith('bertjax'))))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  loaded = json.loads(result.stdout.strip().splitlines()[-1])
  assert {"bertjax.training.loop", "bertjax.cli"} <= set(loaded)
  assert not [m for m in loaded if m.startswith("bertjax.tools")]
