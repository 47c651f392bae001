"""JAX's persistent compilation cache in the test processes, for programs on one device only.

The processes tests start (`bertjax` runs, multi-process workers) share one cache per session
(tests/conftest.py). In the test processes themselves it was off: executables loaded from it
ran the 2x2x2 RTD step's collectives in different orders on different simulated devices and
deadlocked (jax 0.10.2; docs/results/2026-11-27-cpu-cache-collective-deadlock.md). A program on
one device has no collective, so loading it cannot meet that; and the test processes compile
the same one-device programs again and again (a model rebuilt by the next test, a parity check
per parametrisation; how often: docs/results/2026-12-02-suite-time.md).

JAX has no per-program switch, so `cache_one_device_programs` wraps jax._src.compiler's
cache-key function (jax 0.10): a program on several devices gets no key, which JAX treats as
"not cached" (compiled fresh, never written). Where that function is not what it wraps (another
JAX), the cache stays off, as before, and the reason is returned.
"""

from __future__ import annotations

import inspect

import jax
import numpy as np


def cache_one_device_programs() -> str:
  """Turns the persistent cache on in this process for one-device programs; "" when done,
  else why not (the cache then stays off)."""
  try:
    from jax._src import compiler
  except ImportError as e:  # pragma: no cover - a JAX without the module
    return f"jax._src.compiler: {e}"
  original = getattr(compiler, "_get_cache_key", None)
  if original is None or "devices" not in inspect.signature(original).parameters:
    return "jax._src.compiler._get_cache_key(options, backend, computation, devices) not found"
  if getattr(original, "one_device_only", False):
    return ""

  def one_device_key(*args, devices, **kwargs):
    if np.size(devices) != 1:
      return None
    return original(*args, devices=devices, **kwargs)

  one_device_key.one_device_only = True
  compiler._get_cache_key = one_device_key
  jax.config.update("jax_enable_compilation_cache", True)
  return ""
