"""The fast tier, `python -m pytest -m "not slow"`: the loop a developer runs before each commit
(docs/architecture.md, "Tests"). It must still reach every module of the package, so a run of
it fails when one was never imported by its tests: each test process writes the `bertjax`
modules it imported, and the run that started them (pytest's main process) fails naming the
modules none of them imported. A module is imported by the test that uses it (the CLI's
commands import theirs when they run), so a module missing here has no fast test.

Which tests it leaves out: those marked `slow` (end-to-end runs, several processes, kills),
benchmarks (`-m benchmark`, minutes of the PyTorch reference; so that `-m "not slow"` leaves
them out as the default `-m "not benchmark"` does), and every test whose measured time in
tests/durations.json is LIMIT_S or more, unless it is marked `fast` (a module's one test that
reaches it). A test not measured yet counts as fast until the durations are refreshed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "bertjax"
EXPRESSION = "not slow"
# Seconds (setup, call and teardown, on the 2-core machine that measured tests/durations.json)
# from which a test is left to the full suite: set so the tier fits its 5 minutes on two
# workers (what it took: docs/results/2026-12-02-suite-time.md).
LIMIT_S = 2.0


def package_modules() -> set[str]:
  """Every module of bertjax/, by its import name."""
  names = set()
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
  return names


def is_fast_tier(config) -> bool:
  """`-m "not slow"` (or the older spelling, `-m "not slow and not benchmark"`)."""
  return " ".join(config.option.markexpr.split()) in (EXPRESSION,
                                                     f"{EXPRESSION} and not benchmark")


def mark_slow(items, seconds: dict[str, float]) -> None:
  """Benchmarks, and tests measured at LIMIT_S or more that are not marked `fast`, get the
  `slow` mark."""
  for item in items:
    if item.get_closest_marker("slow"):
      continue
    if item.get_closest_marker("benchmark") or (
        seconds.get(item.nodeid, 0.0) >= LIMIT_S and not item.get_closest_marker("fast")):
      item.add_marker(pytest.mark.slow)


def _record_dir(config) -> Path:
  """The directory the main process's basetemp is: xdist's workers have theirs inside it."""
  base = config._tmp_path_factory.getbasetemp()
  return base.parent if hasattr(config, "workerinput") else base


def session_finish(session) -> None:
  """pytest_sessionfinish: in each test process, the modules it imported; in the main process,
  once every worker has written, the check."""
  config = session.config
  if not is_fast_tier(config):
    return
  if config.option.keyword or config.args_source != pytest.Config.ArgsSource.TESTPATHS:
    return  # a selection of the tier (-k, some files) reaches only some modules
  imported = sorted(name for name in sys.modules if name == "bertjax" or
                    name.startswith("bertjax."))
  directory = _record_dir(config)
  worker = config.workerinput["workerid"] if hasattr(config, "workerinput") else "main"
  (directory / f"fast-tier-modules-{worker}.json").write_text(json.dumps(imported))
  if hasattr(config, "workerinput"):
    return
  reached: set[str] = set()
  for path in directory.glob("fast-tier-modules-*.json"):
    reached.update(json.loads(path.read_text()))
  if not reached:
    return  # no test process ran (a collection error, nothing selected)
  missing = sorted(package_modules() - reached)
  if missing:
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    message = (f"the fast tier ({EXPRESSION!r}) imported none of these modules, so none has a "
               f"fast test: {', '.join(missing)}")
    if terminal:
      terminal.write_line(f"FAILED fast tier: {message}", red=True)
    else:  # pragma: no cover
      print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
