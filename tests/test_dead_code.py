"""No dead public code: every top-level public function and class of bertjax/ is used somewhere.

"Public" is a name without a leading underscore, defined at the top level of a module of
bertjax/ (`def`, `async def`, `class`). It is used when its name occurs as an identifier (a
name, an attribute, a name in an `import`) in another .py file under bertjax/, tests/, launch/
or configs/, or elsewhere in its own file than inside its own definition (a recursive call
does not count), or inside `code` in README.md, launch/README.md or a page of docs/ other than
docs/CHANGELOG.md (history names what was removed or renamed, which keeps nothing alive).

Names are matched, not resolved: a name used for something else elsewhere counts as a use, so
the check misses some dead code but does not report live code. The few names reached only
through a string or a framework are in `ALLOWED`, each with its reason. The check also runs
once on the package with a dead function added, and must report it there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "bertjax"
# Where uses are looked for: every .py file under these directories.
CODE_DIRS = ("bertjax", "tests", "launch", "configs")
# Markdown whose `code` counts as a use (CHANGELOG.md: history, see the module docstring).
DOC_FILES = ("README.md", "launch/README.md")
DOC_DIR = "docs"
SKIPPED_DOCS = ("CHANGELOG.md",)

# Public names reached by name only, never as an identifier in the code: {(file, name): why}.
# Keep it short: an entry must name its file and say who reaches it. Empty today: the entry
# points reached by name live outside bertjax/ (configs' `get_config`, pytest's hooks in
# tests/conftest.py) or are also named as identifiers where they are reached (each CLI module's
# `register`, called as `module.register(add)`; its commands, passed as `fn=`; the console
# script `bertjax.__main__:entry`, also called at the end of bertjax/__main__.py).
ALLOWED: dict[tuple[str, str], str] = {}

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)


def read_sources() -> dict[str, str]:
  """Repository-relative path -> source of every .py file the check reads."""
  return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8")
          for d in CODE_DIRS for p in sorted((REPO / d).rglob("*.py"))}


def read_docs() -> dict[str, str]:
  paths = [REPO / f for f in DOC_FILES if (REPO / f).is_file()]
  paths += [p for p in sorted((REPO / DOC_DIR).rglob("*.md")) if p.name not in SKIPPED_DOCS]
  return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in paths}


def definitions(path: str, tree: ast.Module) -> list[tuple[str, int, str, ast.AST]]:
  """(path, line, name, node) of the top-level public functions and classes of a module."""
  return [(path, node.lineno, node.name, node) for node in tree.body
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
          and not node.name.startswith("_")]


def used_names(tree: ast.AST, skip: ast.AST | None = None) -> set[str]:
  """Every identifier `tree` uses: names, attributes, imported names and their aliases; not
  inside `skip` (a definition's own body)."""
  found: set[str] = set()
  todo = [tree]
  while todo:
    node = todo.pop()
    if node is skip:
      continue
    if isinstance(node, ast.Name):
      found.add(node.id)
    elif isinstance(node, ast.Attribute):
      found.add(node.attr)
    elif isinstance(node, ast.alias):
      found.add(node.name.rpartition(".")[2])
      if node.asname:
        found.add(node.asname)
    todo.extend(ast.iter_child_nodes(node))
  return found


def doc_names(text: str) -> set[str]:
  """The identifiers inside fenced code blocks and `code` spans of a Markdown text."""
  found: set[str] = set()
  for block in _FENCE.finditer(text):
    found.update(_IDENTIFIER.findall(block.group(0)))
  for span in _CODE_SPAN.finditer(_FENCE.sub("", text)):
    found.update(_IDENTIFIER.findall(span.group(2)))
  return found


def dead_code(sources: dict[str, str], docs: dict[str, str]) -> list[str]:
  """"file:line name" of each public top-level function or class of bertjax/ used nowhere."""
  trees = {path: ast.parse(source, filename=path) for path, source in sources.items()}
  per_file = {path: used_names(tree) for path, tree in trees.items()}
  in_docs = set().union(*(doc_names(text) for text in docs.values()))
  dead = []
  for path, tree in trees.items():
    if not path.startswith("bertjax/"):
      continue
    for _, line, name, node in definitions(path, tree):
      if (path, name) in ALLOWED or name in in_docs:
        continue
      if any(name in names for other, names in per_file.items() if other != path):
        continue
      if name in used_names(tree, skip=node):
        continue
      dead.append(f"{path}:{line} {name}")
  return dead


def test_no_dead_public_functions_or_classes():
  dead = dead_code(read_sources(), read_docs())
  assert not dead, ("public functions and classes used nowhere (delete them, use them, or add "
                    "them to ALLOWED with the reason):\n" + "\n".join(dead))


def test_allowed_entries_still_exist():
  """An ALLOWED entry cannot outlive its definition."""
  sources = read_sources()
  defined = {(path, name) for path, source in sources.items() if path.startswith("bertjax/")
             for _, _, name, _ in definitions(path, ast.parse(source))}
  stale = sorted(set(ALLOWED) - defined)
  assert not stale, f"ALLOWED names what no longer exists: {stale}"


def test_the_check_reports_an_added_dead_function():
  """Not vacuous: a function nothing uses, added to a module, is reported at its line; one that
  only calls itself is still dead; a use of it in another module makes it live again."""
  sources, docs = read_sources(), read_docs()
  path = "bertjax/data/options.py"
  line = sources[path].count("\n") + 3
  sources[path] += ("\n\ndef unused_helper_for_the_check(n):\n"
                    "  return unused_helper_for_the_check(n - 1)\n")
  assert f"{path}:{line} unused_helper_for_the_check" in dead_code(sources, docs)
  sources["tests/test_dead_code_probe.py"] = (
      "from bertjax.data.options import unused_helper_for_the_check\n")
  assert not [d for d in dead_code(sources, docs) if "unused_helper_for_the_check" in d]
