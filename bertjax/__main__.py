"""The `bertjax` command (and `python -m bertjax`): the process's memory set up, then the CLI.

On a CPU host the commands that run steps re-execute themselves once with glibc tunables that
keep freed memory in the process, so XLA's per-step temporaries are not faulted in afresh every
step (`BERTJAX_MALLOC_TUNABLES=0` turns this off); on a GPU host they run under the XLA flags
of `GPU_XLA_FLAGS` (`BERTJAX_GPU_XLA_FLAGS=0` turns them off).

The guide: docs/performance.md, 'Where a CPU step's time goes' and 'GPU'.
"""

from __future__ import annotations

import os
import sys

from bertjax.parallel import host

# One arena (other threads' arenas map large blocks whatever else is set), no `mmap` for blocks
# and no trimming of the heap: from the first steps on, the temporaries reuse pages already
# faulted in. The cost is a resident set that stays at its peak (docs/performance.md).
_RETAIN_FREED_MEMORY = ("glibc.malloc.arena_max=1", "glibc.malloc.mmap_max=0",
                        "glibc.malloc.trim_threshold=1099511627776")
_HUGE_PAGES = "glibc.malloc.hugetlb=1"  # 2 MiB pages for what is faulted in ("madvise" THP)
# The commands that run XLA programs on this machine step after step. The others (a TPU
# slice's compile, data, tokenizers, conversions) would only pay for the single arena: the
# compiler's threads contend for its lock (docs/results/2026-11-28-malloc-tunables-where.md).
STEP_COMMANDS = frozenset({"train", "finetune", "eval", "fewshot", "generate", "bench",
                           "doctor", "checkpoint-bench"})


def _thp_madvise(thp_mode_file: str) -> bool:
  try:
    with open(thp_mode_file) as f:
      return "[madvise]" in f.read()
  except OSError:
    return False


def malloc_environment(argv: list[str], environ: dict[str, str] | None = None,
                       thp_mode_file: str = "/sys/kernel/mm/transparent_hugepage/enabled",
                       dev: str = "/dev") -> dict[str, str] | None:
  """The environment to re-execute `bertjax ARGV...` with, or None where it would change
  nothing or not pay: not Linux, turned off, a command that runs no steps, a host whose JAX
  computes on a TPU or GPU (XLA's temporaries live there, not in this heap), or every tunable
  already set (by the user or by the first execution). Huge pages only in the kernel's
  "madvise" mode ("always" already covers every mapping; "never" ignores the advice)."""
  environ = dict(os.environ if environ is None else environ)
  if not sys.platform.startswith("linux") or environ.get("BERTJAX_MALLOC_TUNABLES") == "0":
    return None
  if not argv or argv[0] not in STEP_COMMANDS or not host.computes_on_cpu(environ, dev):
    return None
  wanted = _RETAIN_FREED_MEMORY + ((_HUGE_PAGES,) if _thp_madvise(thp_mode_file) else ())
  present = environ.get("GLIBC_TUNABLES", "")
  chosen = {item.split("=", 1)[0] for item in present.split(":") if item}
  added = [t for t in wanted if t.split("=", 1)[0] not in chosen]
  if not added:
    return None
  environ["GLIBC_TUNABLES"] = ":".join(([present] if present else []) + added)
  return environ


# XLA flags the command adds on a GPU host for the commands that run steps, each kept for a
# measured gain (docs/results/2026-11-28-h200-gpu-session.md, one H200):
GPU_XLA_FLAGS = (
    # Every GEMM through cuBLAS instead of XLA's Triton GEMM fusions: GPT-2 medium's LM-head
    # products (vocabulary 50,257) were more than twice as slow as Triton fusions, its
    # per-layer GEMMs and BERT-large's no faster. The compile also skips the Triton GEMMs'
    # autotuning.
    "--xla_gpu_enable_triton_gemm=false",
)


def gpu_xla_flags(argv: list[str], environ: dict[str, str] | None = None,
                  dev: str = "/dev") -> str | None:
  """XLA_FLAGS for `bertjax ARGV...` on a host whose JAX computes on a GPU: the user's flags
  and each of `GPU_XLA_FLAGS` they did not set themselves; None where nothing changes (another
  platform, a command that runs no steps, `BERTJAX_GPU_XLA_FLAGS=0`, every flag already set).
  XLA reads XLA_FLAGS when JAX starts its backend, so setting it before the CLI is imported
  is enough (no re-execution)."""
  environ = dict(os.environ if environ is None else environ)
  if environ.get("BERTJAX_GPU_XLA_FLAGS") == "0":
    return None
  if not argv or argv[0] not in STEP_COMMANDS or not host.computes_on_gpu(environ, dev):
    return None
  present = environ.get("XLA_FLAGS", "")
  added = [f for f in GPU_XLA_FLAGS if f.split("=", 1)[0] not in present]
  if not added:
    return None
  return " ".join(([present] if present.strip() else []) + added)


def entry() -> int:
  flags = gpu_xla_flags(sys.argv[1:])
  if flags is not None:
    os.environ["XLA_FLAGS"] = flags
  environ = malloc_environment(sys.argv[1:])
  # glibc reads tunables only at process start, hence the re-execution; a tunable the user set
  # in GLIBC_TUNABLES is kept, and library users set GLIBC_TUNABLES themselves.
  if environ is not None and getattr(sys, "orig_argv", None):
    try:
      os.execve(sys.executable, sys.orig_argv, environ)  # same PID: launchers still wait on it
    except OSError:
      pass  # carry on with glibc's defaults
  from bertjax.cli import main
  return main()


if __name__ == "__main__":
  sys.exit(entry())
