"""The persistent compilation cache in the test processes (tests/compile_cache.py): one-device
programs are written and loaded, programs on several devices never are; with the cache warm the
collective tests (the 2x2x2 RTD step) do not deadlock and a bit-exact resume test passes, as
it does cold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PROGRAMS = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, {tests!r})
    from compile_cache import cache_one_device_programs
    assert cache_one_device_programs() == ""
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
    x = np.arange(64.0, dtype=np.float32)

    def one_device(x):
      return jnp.sin(x) * 3 + 1

    def across_devices(x):
      return jnp.cos(x).sum()  # an all-reduce across the 8

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    total = jax.jit(across_devices)(sharded)
    before = len(hits)
    one = jax.jit(one_device)(x)
    print(json.dumps({{"one_device_hits": len(hits) - before, "mesh_hits": before,
                      "values": [float(one.sum()), float(total)]}}))
""")


def _run_programs(cache: Path) -> dict:
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  result = subprocess.run([sys.executable, "-c", PROGRAMS.format(tests=str(TESTS))], env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.splitlines()[-1])


def test_one_device_programs_are_cached_and_mesh_programs_never(tmp_path):
  """Two processes compile the same two programs: the one-device program is written by the
  first and loaded by the second; the 8-device program (an all-reduce) is compiled fresh by
  both and never written. Broken variant (the wrapper returning a key for every program): the
  second process loads the mesh program too, and this fails."""
  cache = tmp_path / "cache"
  cold, warm = _run_programs(cache), _run_programs(cache)
  assert (cold["one_device_hits"], cold["mesh_hits"]) == (0, 0), cold
  assert (warm["one_device_hits"], warm["mesh_hits"]) == (1, 0), warm
  assert warm["values"] == cold["values"]
  names = sorted(p.name for p in cache.iterdir())
  assert any(name.startswith("jit_one_device") for name in names), names
  assert not any(name.startswith("jit_across_devices") for name in names), names


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_collective_and_resume_tests_pass_cold_and_warm(tmp_path):
  """The 2x2x2 RTD step's mesh-invariance test (the one that deadlocked with executables
  loaded from the cache) and a bit-exact resume test, in a fresh pytest process three times
  over one cache: cold, then warm twice. Each run passes, well inside its timeout (a deadlock
  ends in XLA's collective abort or the timeout)."""
  cache = tmp_path / "cache"
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
  env.pop("BERTJAX_TEST_TIMES", None)
  selection = [
      "tests/test_rtd.py::test_rtd_steps_are_mesh_invariant[shared]",
      "tests/test_resilience.py::test_a_run_killed_after_a_rewind_resumes_onto_the_same_batches"]
  for attempt in ("cold", "warm", "warm again"):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         "--timeout", "240", *selection], cwd=TESTS.parent, env=env, capture_output=True,
        text=True, timeout=400)
    assert result.returncode == 0 and "2 passed" in result.stdout, (
        attempt, result.stdout[-3000:], result.stderr[-2000:])
    if attempt == "cold":
      assert any(cache.iterdir()), "the cold run wrote nothing to the cache"
