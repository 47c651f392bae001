"""The package's one-way dependency: `bertjax/tools/` (measurement, AOT compile, benchmarks)
imports the training core; the core never imports it.

Checked twice: by running the imports (nothing of `bertjax.tools` is loaded by importing the
training entry points or the CLI) and by reading the source (no module of the core imports
`bertjax.tools` at all, except `bertjax/cli.py`, and that only inside the command handlers that
need it)."""

import ast
import json
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "bertjax"
TOOLS = "bertjax.tools"
# The one core module allowed to import the tools, inside functions only (lazily).
LAZY_ALLOWED = PACKAGE / "cli.py"


def _is_tools(name: str) -> bool:
  return name == TOOLS or name.startswith(TOOLS + ".")


def _package_of(path: pathlib.Path) -> list[str]:
  """The dotted package a module's relative imports start from."""
  parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
  return parts[:-1]  # a package's __init__ and its modules alike: the directory


def _tools_imports(path: pathlib.Path) -> list[tuple[int, str, bool]]:
  """(line, module imported, whether inside a function) of each import of bertjax.tools in a
  source file; relative imports resolved, `importlib.import_module("...")` included."""
  package = _package_of(path)
  found = []

  def imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
      return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package[:len(package) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
      if _is_tools(base) and base != TOOLS:
        return [base]  # from bertjax.tools.bench import OurStep
      return [f"{base}.{alias.name}" for alias in node.names]  # from bertjax import tools
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module",
                                                                           "__import__")):
      return [node.args[0].value]
    return []

  def visit(node: ast.AST, in_function: bool) -> None:
    for child in ast.iter_child_nodes(node):
      for name in imported(child):
        if _is_tools(name):
          found.append((child.lineno, name, in_function))
          break
      visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                     ast.Lambda)))

  visit(ast.parse(path.read_text(), str(path)), False)
  return found


def _core_files() -> list[pathlib.Path]:
  return sorted(p for p in PACKAGE.rglob("*.py") if PACKAGE / "tools" not in p.parents)


def test_importing_the_core_and_the_cli_loads_no_tools():
  code = ("import json, sys\n"
          "import bertjax.train, bertjax.loop, bertjax.finetune, bertjax.cli\n"
          "print(json.dumps(sorted(m for m in sys.modules if m.startswith('bertjax'))))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  loaded = json.loads(result.stdout.strip().splitlines()[-1])
  assert {"bertjax.train", "bertjax.loop", "bertjax.finetune", "bertjax.cli"} <= set(loaded)
  assert not [m for m in loaded if _is_tools(m)], (
      f"importing the core loaded {[m for m in loaded if _is_tools(m)]}: the core must not "
      "import bertjax.tools (cli.py: only inside the command handlers)")


def test_no_core_module_imports_the_tools():
  offences = []
  for path in _core_files():
    for line, name, in_function in _tools_imports(path):
      if path == LAZY_ALLOWED and in_function:
        continue
      where = "inside a function" if in_function else "at module level"
      offences.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} {where}")
  assert not offences, ("the training core imports bertjax.tools (only bertjax/cli.py may, "
                        "lazily inside its command handlers):\n" + "\n".join(offences))


def test_the_static_check_sees_the_clis_lazy_imports():
  """The check above is not vacuous: it finds the CLI's own (allowed) imports of the tools,
  each inside a function, and the package has core modules to check."""
  lazy = _tools_imports(LAZY_ALLOWED)
  assert lazy and all(in_function for _, _, in_function in lazy)
  assert {"bertjax.tools.aot", "bertjax.tools.bench"} <= {name for _, name, _ in lazy}
  assert len(_core_files()) > 20
