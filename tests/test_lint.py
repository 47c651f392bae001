"""The lint the project holds itself to: `ruff check bertjax/` with the rule set in
pyproject.toml ([tool.ruff.lint]) is clean; tests are held to pyflakes' errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "ruff", "check", *args], cwd=ROOT,
                        capture_output=True, text=True)


def test_the_package_is_lint_clean():
  result = _ruff("bertjax")
  assert result.returncode == 0, result.stdout + result.stderr


def test_the_tests_have_no_pyflakes_errors():
  result = _ruff("tests", "--select", "F")
  assert result.returncode == 0, result.stdout + result.stderr


def test_the_lint_catches_an_import_inside_a_function(tmp_path):
  # The broken variant: what the rule set must refuse (PLC0415 outside the CLI).
  module = tmp_path / "bertjax_module.py"
  module.write_text('"""A module."""\n\n\ndef f():\n  import json\n  return json\n')
  result = _ruff("--config", str(ROOT / "pyproject.toml"), str(module))
  assert result.returncode == 1 and "PLC0415" in result.stdout, result.stdout
