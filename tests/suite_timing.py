"""Where the suite's time goes, per test, and the order that balances the workers.

Two pieces conftest.py calls from its hooks:

- With BERTJAX_TEST_TIMES=DIR set, every test process appends one JSON line per test to
  DIR/<worker>.jsonl: its wall seconds by phase (setup, call, teardown), the seconds JAX spent
  compiling inside the test process (tracing, lowering, XLA's backend compile, from
  jax.monitoring's duration events) and the number of backend compiles (with
  BERTJAX_TEST_COMPILE_KEYS=1 also each program's cache key, device count and seconds), the
  CPU seconds of the processes the test started and waited for (os.times' children: a
  `bertjax` run's interpreter start, imports, compiles and steps), and when it started. `python tests/durations_table.py
  DIR` turns them into the tables of docs/results (the slowest tests, the files, the workers'
  timelines) and into tests/durations.json.
- The collected files are run longest first, by tests/durations.json (each test's seconds, as
  measured; a file's are its tests'), so that the xdist workers (`--dist loadfile`, one
  file at a time each) end together: the longest-processing-time-first rule. A file not in it
  (a new one) counts as the median file. The same seconds decide which tests the fast tier
  leaves out (tests/fast_tier.py). docs/architecture.md ("Tests") says when to refresh it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
# The duration events of one jit's compile, inside the test process.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def test_seconds() -> dict[str, float]:
  """Each test's measured seconds (setup, call and teardown), by node id."""
  if not DURATIONS.exists():
    return {}
  return json.loads(DURATIONS.read_text())["tests"]


def file_seconds(tests: dict[str, float]) -> dict[str, float]:
  """Each test file's seconds (its path from the repository root): its tests' `tests`."""
  files: dict[str, float] = {}
  for nodeid, seconds in tests.items():
    path = nodeid.split("::")[0]
    files[path] = files.get(path, 0.0) + seconds
  return files


def longest_first(items: list, seconds: dict[str, float]) -> list:
  """`items` grouped by file, files in descending measured seconds (the median for a file not
  measured), each file's tests in their collected order. Deterministic: every xdist worker
  must collect the same order."""
  if not seconds:
    return items
  unknown = statistics.median(seconds.values())
  order: dict[str, list] = {}
  for item in items:
    order.setdefault(item.nodeid.split("::")[0], []).append(item)
  files = sorted(order, key=lambda f: (-seconds.get(f, unknown), f))
  return [item for f in files for item in order[f]]


class _Recorder:
  """Per-test compile seconds from jax.monitoring, children CPU from os.times."""

  def __init__(self, directory: Path) -> None:
    self.directory = directory
    self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    self.compile_s = 0.0
    self.compiles = 0
    self.current: dict = {}
    self.programs: list = []
    import jax
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    if os.environ.get("BERTJAX_TEST_COMPILE_KEYS"):
      self._record_programs()

  def _record_programs(self) -> None:
    """Each compile's program (its persistent-cache key), device count and seconds: which
    compiles repeat a program compiled before, in this process or another. JAX internals
    (jax._src.compiler, 0.10): a measurement aid, off unless BERTJAX_TEST_COMPILE_KEYS is set."""
    from jax._src import compilation_cache, compiler
    compile_or_get_cached = compiler.compile_or_get_cached

    def recorded(backend, computation, devices, compile_options, *args, **kwargs):
      start = time.perf_counter()
      executable = compile_or_get_cached(backend, computation, devices, compile_options,
                                         *args, **kwargs)
      key = compilation_cache.get_cache_key(computation, devices, compile_options, backend)
      self.programs.append([key[-16:], int(devices.size), round(time.perf_counter() - start, 3)])
      return executable

    compiler.compile_or_get_cached = recorded

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS:
      self.compile_s += duration
      self.compiles += event == _BACKEND_COMPILE

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(self, item, nextitem):
    times = os.times()
    self.compile_s, self.compiles, self.programs = 0.0, 0, []
    self.current = {"test": item.nodeid, "worker": self.worker, "start": time.time()}
    yield
    after = os.times()
    self.current.update(
        compile_s=round(self.compile_s, 3), compiles=self.compiles,
        children_cpu_s=round(after.children_user + after.children_system
                             - times.children_user - times.children_system, 3))
    if self.programs:
      self.current["programs"] = self.programs
    self.directory.mkdir(parents=True, exist_ok=True)
    with open(self.directory / f"{self.worker}.jsonl", "a") as f:
      f.write(json.dumps(self.current) + "\n")

  def pytest_runtest_logreport(self, report):
    if report.nodeid == self.current.get("test"):
      self.current[report.when] = round(report.duration, 3)
      if report.when == "call":
        self.current["outcome"] = report.outcome


def configure(config) -> None:
  """pytest_configure: the recorder, where BERTJAX_TEST_TIMES asks for it."""
  directory = os.environ.get("BERTJAX_TEST_TIMES")
  if directory:
    config.pluginmanager.register(_Recorder(Path(directory)), "bertjax-test-times")


def order(items: list, tests: dict[str, float]) -> None:
  """pytest_collection_modifyitems: the files longest first."""
  items[:] = longest_first(items, file_seconds(tests))
