"""The `bertjax` command (and `python -m bertjax`): the process's memory set up, then the CLI.

XLA's CPU runtime allocates each step's temporaries afresh, and on Linux a fresh large
allocation is mmap'd memory whose every 4 KiB page faults on first touch. With scan over
layers a BERT-base step zero-fills ~0.5 GB of per-layer stacks (gradients and saved
activations), and the page faults made that 13% of the step on the 2-core CPU machine
(docs/performance.md). glibc's `glibc.malloc.hugetlb=1` tunable madvises those mappings into
transparent huge pages (one fault per 2 MiB): the step ran 1.15-1.25x faster. glibc reads
tunables only at process start, so the command re-executes itself once with the tunable set.
`BERTJAX_HUGEPAGES=0` turns this off; library users set `GLIBC_TUNABLES` themselves.
"""

from __future__ import annotations

import os
import sys

_TUNABLE = "glibc.malloc.hugetlb=1"


def hugepage_environment(environ: dict[str, str] | None = None,
                         thp_mode_file: str = "/sys/kernel/mm/transparent_hugepage/enabled"
                         ) -> dict[str, str] | None:
  """The environment to re-execute with, or None where it would change nothing: not Linux,
  turned off, a malloc tunable already chosen, or transparent huge pages not in "madvise"
  mode ("always" already covers every mapping; "never" ignores the advice)."""
  environ = dict(os.environ if environ is None else environ)
  if (not sys.platform.startswith("linux") or environ.get("BERTJAX_HUGEPAGES") == "0"
      or "glibc.malloc.hugetlb" in environ.get("GLIBC_TUNABLES", "")):
    return None
  try:
    with open(thp_mode_file) as f:
      if "[madvise]" not in f.read():
        return None
  except OSError:
    return None
  tunables = environ.get("GLIBC_TUNABLES", "")
  environ["GLIBC_TUNABLES"] = f"{tunables}:{_TUNABLE}" if tunables else _TUNABLE
  return environ


def entry() -> int:
  environ = hugepage_environment()
  if environ is not None and getattr(sys, "orig_argv", None):
    try:
      os.execve(sys.executable, sys.orig_argv, environ)  # same PID: launchers still wait on it
    except OSError:
      pass  # carry on without huge pages
  from bertjax.cli import main
  return main()


if __name__ == "__main__":
  sys.exit(entry())
