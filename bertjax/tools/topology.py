"""Cloud TPU slices by name, and libtpu's compile-only devices for them: what `bertjax compile`
compiles for and the topology-layout tests lay meshes over.

Device naming (as Cloud TPU's accelerator types): v2-N, v3-N, v4-N and v5p-N count
TensorCores (v4/v5p: 2 per chip, one megacore device per chip; v2/v3: 2 per chip, each core a
device), v5e-N (v5litepod-N) and v6e-N count chips (one core, one device each).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

import jax
import ml_collections
from jax._src import xla_bridge
from jax.experimental import topologies

from bertjax.parallel import sharding

GiB = 2 ** 30

LIBTPU_MISSING = ("bertjax compile needs libtpu (the TPU compiler) to compile for a TPU "
                  "topology on this machine: pip install 'bertjax[tpu]' (or "
                  "pip install 'jax[tpu]'); no TPU is needed")


@dataclasses.dataclass(frozen=True)
class Generation:
  """What a TPU generation's devices hold and do."""
  name: str
  # Prefix of libtpu's topology names ("v4:2x2x2").
  topology_prefix: str
  chip_config: str           # "megacore" (one device per chip) or "default"
  dims: int                  # 2-D or 3-D torus
  counts_cores: bool         # accelerator-type N counts TensorCores (True) or chips
  devices_per_chip: int
  hbm_per_chip: float        # bytes
  peak_per_chip: float       # dense bf16 FLOP/s (vendor data sheet)
  # Bidirectional inter-chip interconnect bandwidth per chip, bytes/s (None: not published
  # in a form used here).
  ici_per_chip: float | None = None


# HBM and bf16 peaks per chip from the Cloud TPU system-architecture pages (v5p's "95 GB" is
# 96 GiB: its compiler offers programs 95.74 GiB). Programs get the HBM less a few hundred MiB
# the runtime reserves; the compiler, which knows the exact figure, is the final judge.
# ICI: the "bidirectional inter-chip interconnect bandwidth (per chip)" rows of the same pages
# (v5e 400, v5p 1200, v6e 800 GB/s); v4's page gives none: 6 links of 400 Gb/s each way
# (Jouppi et al. 2023, "TPU v4") = 600 GB/s.
GENERATIONS: dict[str, Generation] = {
    "v2": Generation("v2", "v2", "default", 2, True, 2, 16 * GiB, 45e12),
    "v3": Generation("v3", "v3", "default", 2, True, 2, 32 * GiB, 123e12),
    "v4": Generation("v4", "v4", "megacore", 3, True, 1, 32 * GiB, 275e12, 600e9),
    "v5p": Generation("v5p", "v5", "megacore", 3, True, 1, 96 * GiB, 459e12, 1200e9),
    "v5e": Generation("v5e", "v5e", "default", 2, False, 1, 16 * GiB, 197e12, 400e9),
    "v6e": Generation("v6e", "v6e", "default", 2, False, 1, 32 * GiB, 918e12, 800e9),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v5": "v5p"}

TOPOLOGY_FORMS = ("v2-N, v3-N (N TensorCores: 8, 32, 128, ...; 2 devices per chip)",
                  "v4-N, v5p-N (N TensorCores, N/2 chips in a 3-D torus: 8, 16, 32, 64, ...)",
                  "v5e-N, v5litepod-N, v6e-N (N chips: 1, 4, 8, 16, ..., 256)",
                  "or an explicit chip grid: v4:2x2x4, v5p:4x4x8, v5e:4x8, v3:4x4")


@dataclasses.dataclass(frozen=True)
class TopologySpec:
  """A TPU slice: how to ask libtpu for it and what each of its devices offers."""
  name: str                      # as the user wrote it, e.g. "v4-64"
  generation: str                # "v4"
  chips: int
  devices: int
  topology_name: str             # libtpu's, e.g. "v4:2x4x4"
  chip_config_name: str
  chips_per_host_bounds: tuple[int, int, int]
  hbm_per_device: float          # bytes
  peak_flops_per_device: float   # bf16 FLOP/s
  ici_per_device: float | None   # bidirectional ICI bytes/s (a chip's, shared by its devices)
  # Slices of this shape joined over the data-center network (multi-slice); chips and
  # devices above are per slice.
  num_slices: int = 1

  @property
  def total_devices(self) -> int:
    return self.devices * self.num_slices

  @property
  def grid(self) -> tuple[int, ...]:
    return tuple(int(x) for x in self.topology_name.split(":")[1].split("x"))


def _grid(chips: int, dims: int) -> tuple[int, ...]:
  """The usual chip grid of a power-of-two slice (v4-64: 32 chips = 2x4x4; v5e-32 = 4x8)."""
  k = int(math.log2(chips))
  if dims == 2:
    return (2 ** (k // 2), 2 ** (k - k // 2))
  if chips == 4:
    return (2, 2, 1)
  exps = [k // 3] * 3
  for i in range(k % 3):
    exps[2 - i] += 1
  return tuple(2 ** e for e in exps)


def _unknown(name: str, why: str = "") -> ValueError:
  return ValueError(f"unknown TPU topology {name!r}{': ' + why if why else ''}; accepted forms: "
                    + "; ".join(TOPOLOGY_FORMS))


def parse_topology(name: str, num_slices: int = 1) -> TopologySpec:
  """'v4-64' (or 'v4:2x4x4') -> TopologySpec of `num_slices` such slices; an unknown name
  raises ValueError listing the accepted forms."""
  if num_slices < 1:
    raise ValueError(f"--slices must be at least 1, got {num_slices}")
  text = name.strip().lower()
  explicit = re.fullmatch(r"(v\d[a-z]*):(\d+(?:x\d+){1,2})", text)
  named = re.fullmatch(r"(v\d[a-z]*)-(\d+)", text)
  if not (explicit or named):
    raise _unknown(name)
  gen_name = (explicit or named).group(1)
  gen_name = _ALIASES.get(gen_name, gen_name)
  if gen_name not in GENERATIONS:
    raise _unknown(name, f"generation {gen_name!r} is not one of {', '.join(GENERATIONS)}")
  gen = GENERATIONS[gen_name]
  if explicit:
    grid = tuple(int(x) for x in explicit.group(2).split("x"))
    if len(grid) == 2 and gen.dims == 3:
      grid = grid + (1,)
    if len(grid) != gen.dims or min(grid) < 1:
      raise _unknown(name, f"{gen.name} slices are {gen.dims}-D chip grids")
    chips = math.prod(grid)
  else:
    n = int(named.group(2))
    if n < 1 or n & (n - 1):
      raise _unknown(name, f"{n} is not a power of two (give an explicit grid instead)")
    if gen.counts_cores:
      if n < 8:
        raise _unknown(name, f"the smallest {gen.name} slice is {gen.name}-8")
      chips = n // 2
    else:
      chips = n
    grid = _grid(chips, gen.dims)
  host = tuple(min(g, h) for g, h in zip(grid + (1,) * (3 - len(grid)), (2, 2, 1)))
  if gen.name in ("v5e", "v6e") and chips == 8:
    host = (2, 4, 1)  # the 8-chip single-host VM
  return TopologySpec(
      name=name, generation=gen.name, chips=chips, devices=chips * gen.devices_per_chip,
      topology_name=f"{gen.topology_prefix}:{'x'.join(map(str, grid))}",
      chip_config_name=gen.chip_config, chips_per_host_bounds=host,
      hbm_per_device=gen.hbm_per_chip / gen.devices_per_chip,
      peak_flops_per_device=gen.peak_per_chip / gen.devices_per_chip,
      ici_per_device=(None if gen.ici_per_chip is None
                      else gen.ici_per_chip / gen.devices_per_chip),
      num_slices=num_slices)


def libtpu_available() -> bool:
  """Whether the TPU compiler (libtpu) is installed."""
  try:
    return xla_bridge.get_tpu_library_path() is not None
  except Exception:  # noqa: BLE001 - any failure to locate it means "not available"
    return False


def topology_devices(spec: TopologySpec) -> list[Any]:
  """Compile-only devices of the slice(s), with the real `process_index`, `coords` and
  `slice_index` (no TPU needed; needs libtpu)."""
  if not libtpu_available():
    raise RuntimeError(LIBTPU_MISSING)
  # libtpu takes /tmp/libtpu_lockfile so that one process owns the TPU; a compile-only client
  # owns nothing, and two `bertjax compile` runs (or one beside a CPU job) must not collide.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  desc = topologies.get_topology_desc(
      platform="tpu", topology_name=spec.topology_name, chip_config_name=spec.chip_config_name,
      chips_per_host_bounds=spec.chips_per_host_bounds, num_slices=spec.num_slices)
  devices = list(desc.devices)
  if len(devices) != spec.total_devices:
    raise RuntimeError(f"libtpu gave {len(devices)} devices for {spec.num_slices} x "
                       f"{spec.topology_name}, expected {spec.total_devices}")
  return devices


def topology_mesh(config: ml_collections.ConfigDict, spec: TopologySpec,
                  devices: list[Any]) -> jax.sharding.Mesh:
  """The config's ('data', 'fsdp', 'tensor') mesh over the slice's devices (and `dcn_mesh`
  over the slices), or a ValueError naming the mesh, the device count and meshes that would
  work."""
  axes = {k: int(v) for k, v in dict(config.mesh).items()}
  try:
    return sharding.mesh_from_config(config, devices)
  except ValueError as e:
    n = spec.devices
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    tensor = max(d for d in divisors if d <= 8)
    raise ValueError(
        f"mesh {axes} does not divide {spec.name} ({n} devices): {e}. What works: one axis -1 "
        f"and the others' sizes multiplying to a divisor of {n} ({', '.join(map(str, divisors))})"
        f", e.g. mesh.data=-1 mesh.fsdp=1 mesh.tensor=1 (data parallel) or mesh.data=1 "
        f"mesh.fsdp=-1 mesh.tensor={tensor}") from None
