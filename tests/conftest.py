"""Test setup: 8 host devices so meshes like 2x2x2 are real, strict numerics, no implicit rank
promotion."""

import os
import tempfile
import warnings

# Must precede the first `import jax` anywhere in the test session.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No implicit rank promotion: `[B] + [B, L]` raises instead of broadcasting silently (a
# dropped axis then fails loudly). Set in the environment too, so that the bertjax processes
# tests start (training runs, multi-host workers) run under the same rule.
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
# The measured CPU matmul peak (bertjax.training.flops) is cached under BERTJAX_CACHE: tests neither read
# nor write the user's.
os.environ["BERTJAX_CACHE"] = tempfile.mkdtemp(prefix="bertjax-test-cache-")

import jax  # noqa: E402
import pytest  # noqa: E402

# Full-precision fp32 matmuls on CPU, so parity tolerances mean what they say.
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def devices():
  found = jax.devices()
  if len(found) < 8:
    pytest.fail(f"tests need 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), "
                f"found {len(found)}")
  return found


@pytest.fixture(scope="module")
def libtpu(request):
  """Skips the module's TPU compile tests where libtpu is missing, with a warning naming them
  (so that a run without it says what it did not check)."""
  from bertjax.tools import aot
  if not aot.libtpu_available():
    reason = (f"libtpu is not installed (pip install 'bertjax[tpu]'): the TPU compile tests of "
              f"{request.module.__name__} did not run")
    warnings.warn(reason)
    pytest.skip(reason=reason)
