"""Every module docstring under bertjax/ is short: at most `MAX_WORDS` words.

A module docstring says what the module is for in a few lines and links its guide
(docs/*.md); the detail lives in the guide, or in a comment or function docstring next to the
code it describes. Words are counted as `len(docstring.split())` on `ast.get_docstring`; a
module without a docstring counts 0.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "bertjax"
MAX_WORDS = 120
MODULES = sorted(PACKAGE.rglob("*.py"))


def docstring_words(source: str) -> int:
  """Words of the module docstring of `source` (0 without one)."""
  doc = ast.get_docstring(ast.parse(source))
  return len(doc.split()) if doc else 0


def test_modules_found():
  names = {p.relative_to(REPO).as_posix() for p in MODULES}
  assert {"bertjax/__main__.py", "bertjax/training/loop.py"} <= names, sorted(names)[:10]


@pytest.mark.parametrize("module", MODULES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_module_docstring_is_short(module: Path):
  words = docstring_words(module.read_text(encoding="utf-8"))
  assert words <= MAX_WORDS, (
      f"{module.relative_to(REPO).as_posix()}: module docstring has {words} words, over "
      f"{MAX_WORDS}: say what the module is for and link its guide (docs/*.md); move the detail "
      f"into the guide or next to the code it describes (tests/test_docstrings.py)")


@pytest.mark.parametrize("source, words", [
    ('"""One two three."""\nx = 1\n', 3),
    ("x = 1\n", 0),
    ('"""' + "word " * (MAX_WORDS + 1) + '"""\n', MAX_WORDS + 1),
    ('# a comment first\n"""Still the docstring."""\n', 3),
])
def test_docstring_words(source: str, words: int):
  assert docstring_words(source) == words
