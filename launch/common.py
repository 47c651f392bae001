"""What more than one launcher needs: the repository root, the usage error (exit code 2),
argument helpers (split_command, flag_value), printing helpers (show, rel), the TPU slice facts
tpu_vm.py and gke.py share (TpuSlice, parse_tpu_type and their tables) and the data note.

Not a launcher itself: the launchers are scripts run as `python launch/<name>.py`, which puts
launch/ first on sys.path, so each of them imports this module as plain `common`.
Stdlib only, like the cloud launchers.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Runtime versions for JAX (Cloud TPU docs, "TPU software versions").
RUNTIMES = {"v4": "tpu-ubuntu2204-base", "v5p": "v2-alpha-tpuv5",
            "v5litepod": "v2-alpha-tpuv5-lite", "v6e": "v2-alpha-tpuv6e"}
# GKE node labels (cloud.google.com/gke-tpu-accelerator) and machine types per generation.
GKE_ACCELERATORS = {"v4": "tpu-v4-podslice", "v5p": "tpu-v5p-slice",
                    "v5litepod": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice"}
GKE_MACHINES = {"v4": "ct4p-hightpu-4t", "v5p": "ct5p-hightpu-4t",
                "v5litepod": "ct5lp-hightpu-4t", "v6e": "ct6e-standard-4t"}
# Slice shapes (chips -> topology): v4/v5p are 3D tori, v5e/v6e 2D.
TOPOLOGY_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
               256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
TOPOLOGY_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
               256: "16x16"}


class UsageError(Exception):
  """A request that cannot be right (exit code 2)."""


@dataclass(frozen=True)
class TpuSlice:
  """An accelerator type and what it means: chips, hosts, chips per host."""
  accelerator_type: str  # as gcloud spells it, e.g. v4-16, v5litepod-16, v6e-16
  generation: str        # v4 | v5p | v5litepod | v6e
  chips: int
  hosts: int
  chips_per_host: int

  @property
  def runtime_version(self) -> str:
    return RUNTIMES[self.generation]

  @property
  def gke_accelerator(self) -> str:
    return GKE_ACCELERATORS[self.generation]

  @property
  def gke_machine_type(self) -> str:
    if self.generation in ("v5litepod", "v6e") and self.hosts == 1 and self.chips == 8:
      return GKE_MACHINES[self.generation].replace("-4t", "-8t")
    return GKE_MACHINES[self.generation]

  @property
  def topology(self) -> str:
    table = TOPOLOGY_3D if self.generation in ("v4", "v5p") else TOPOLOGY_2D
    return table[self.chips]

  def describe(self, slices: int = 1) -> str:
    if slices > 1:
      return (f"{slices} x {self.accelerator_type} = {slices * self.chips} chips on "
              f"{slices * self.hosts} hosts ({slices} slices over DCN), "
              f"{self.chips_per_host} chips per host, topology {self.topology} per slice")
    return (f"{self.accelerator_type} = {self.chips} chips on {self.hosts} host"
            f"{'s' if self.hosts > 1 else ''} ({self.chips_per_host} chips each), "
            f"topology {self.topology}")


def parse_tpu_type(name: str, hosts: int | None = None) -> TpuSlice:
  """v4-N / v5p-N (N TensorCores, 2 per chip, 4 chips per host), v5litepod-N (alias v5e-N) and
  v6e-N (N chips, 4 per host in multi-host slices; up to 8 on one host). Raises UsageError for
  an unknown type or a `hosts` that does not match it."""
  m = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", name.strip().lower())
  known = ("v4-8/16/32/.../4096, v5p-8/16/.../8192, v5litepod-1/4/8/16/.../256 (or v5e-N), "
           "v6e-1/4/8/16/.../256")
  if not m:
    raise UsageError(f"unknown TPU type {name!r}; known: {known}")
  gen, n = m.group(1), int(m.group(2))
  gen = "v5litepod" if gen == "v5e" else gen
  if gen in ("v4", "v5p"):
    chips = n // 2
    if n % 2 or chips not in TOPOLOGY_3D or chips < 4:
      raise UsageError(f"unknown TPU type {name!r}: {gen}-N counts TensorCores (2 per chip); "
                       f"N must be 8, 16, 32, ... (known: {known})")
    per_host = 4
    n_hosts = chips // per_host
  else:
    chips = n
    if chips not in TOPOLOGY_2D:
      raise UsageError(f"unknown TPU type {name!r}: {gen}-N counts chips; N must be one of "
                       f"{', '.join(map(str, TOPOLOGY_2D))}")
    per_host = chips if chips <= 8 else 4
    n_hosts = 1 if chips <= 8 else chips // 4
  tpu = TpuSlice(f"{gen}-{n}", gen, chips, n_hosts, per_host)
  if hosts is not None and hosts != tpu.hosts:
    raise UsageError(f"--hosts {hosts} does not match --tpu-type {tpu.accelerator_type}: "
                     f"{tpu.describe()}")
  return tpu


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
  """(launcher args, command after the first --)."""
  if "--" in argv:
    i = argv.index("--")
    return argv[:i], argv[i + 1:]
  return argv, []


def flag_value(argv: list[str], flag: str) -> str | None:
  """The value of `flag` in an argv list, as `--flag value` or `--flag=value` (last wins)."""
  value = None
  for i, arg in enumerate(argv):
    if arg == flag and i + 1 < len(argv):
      value = argv[i + 1]
    elif arg.startswith(flag + "="):
      value = arg[len(flag) + 1:]
  return value


def data_note(train: list[str]) -> str | None:
  """What a multi-host `bertjax train` without --config.data.dataset will read, or None."""
  if "train" not in train or any(a.startswith("--config.data.dataset") for a in train):
    return None
  # Process 0 then builds data.sources into the workdir while every host waits: seconds for
  # the embedded sample, hours of a paid slice for a real corpus.
  return ("no --config.data.dataset: process 0 builds data.sources (default: the embedded "
          "Wikipedia sample) into WORKDIR/data on first use; for a real corpus run `bertjax "
          "data build` beforehand onto storage every host reads and pass "
          "--config.data.dataset= (docs/launching.md)")


def show(argv: list[str]) -> str:
  """An argv list as one shell-quoted line."""
  return shlex.join(argv)


def rel(path: Path) -> str:
  """`path` relative to the working directory ('.' for it), as printed in commands."""
  try:
    return os.path.relpath(path) if path.resolve() != Path.cwd().resolve() else "."
  except ValueError:
    return str(path)
