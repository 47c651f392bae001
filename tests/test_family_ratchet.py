"""A ratchet on string dispatch: model families, Hugging Face model_types and objectives are
looked up once in their registries (bertjax/models/families.py, bertjax/hf/formats.py,
bertjax/data/schema.py) and asked, not compared as strings. This counts the comparisons left
outside the registries and the per-family files, and fails above the stored budget; lower the
budget when you remove one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "bertjax"
# The registries and each family's own files, where its name is its own business.
EXEMPT = {
    "models/families.py", "models/encoder.py", "models/gpt.py", "models/t5.py", "models/bart.py",
    "hf/formats.py", "hf/bert.py", "hf/albert.py", "hf/distilbert.py", "hf/electra.py",
    "hf/modernbert.py", "hf/deberta.py", "hf/gpt.py", "hf/t5.py", "hf/bart.py",
    "data/schema.py", "finetune/registry.py",
}
# Lower it as comparisons go; never raise it.
BUDGET = 0
SUBJECTS = ("family", "model_type", "objective")


def _subject(node: ast.AST) -> str | None:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute):
    return node.attr
  return None


def _names_a_subject(node: ast.AST) -> bool:
  name = _subject(node)
  return bool(name) and any(name == s or name.endswith("_" + s) for s in SUBJECTS)


def _is_literal(node: ast.AST) -> bool:
  if isinstance(node, ast.Constant):
    return isinstance(node.value, str)
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return bool(node.elts) and all(
        isinstance(e, ast.Starred) or (isinstance(e, ast.Constant) and isinstance(e.value, str))
        for e in node.elts)
  return False


def _string_keyed_dict(node: ast.AST) -> bool:
  return isinstance(node, ast.Dict) and bool(node.keys) and all(
      isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys)


def comparisons(source: str) -> list[tuple[int, str]]:
  """(line, code) of each string dispatch on a family, model_type or objective: `x.family ==
  "gpt"`, `objective in ("mlm", ...)`, `{"bert": ...}[cfg.family]` or `{...}.get(family)`."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare):
      parts = [node.left, *node.comparators]
      if any(map(_names_a_subject, parts)) and any(map(_is_literal, parts)):
        found.append((node.lineno, ast.unparse(node)))
    elif isinstance(node, ast.Subscript) and _string_keyed_dict(node.value) and _names_a_subject(
        node.slice):
      found.append((node.lineno, ast.unparse(node)))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == "get" and _string_keyed_dict(node.func.value) and node.args
          and _names_a_subject(node.args[0])):
      found.append((node.lineno, ast.unparse(node)))
  return found


def test_the_counter_finds_each_form():
  source = ('a = cfg.family == "gpt"\nb = objective in ("mlm", "rtd")\n'
            'c = {"bert": 1}[config.family]\nd = {"t5": 2}.get(model_type, 0)\n'
            'e = cfg.family_record.is_decoder\nf = spec.model_type == _SPM\n')
  assert [line for line, _ in comparisons(source)] == [1, 2, 3, 4]


def test_string_dispatch_on_families_stays_within_its_budget():
  found = []
  for path in sorted(ROOT.rglob("*.py")):
    relative = path.relative_to(ROOT).as_posix()
    if relative not in EXEMPT:
      found += [f"bertjax/{relative}:{line}: {code}"
                for line, code in comparisons(path.read_text())]
  assert len(found) <= BUDGET, (f"{len(found)} string comparisons of a family, model_type or "
                                f"objective (budget {BUDGET}): ask the registry instead\n"
                                + "\n".join(found))
