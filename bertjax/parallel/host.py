"""What this host computes on, read without starting JAX (nothing here imports it): the
accelerator chips' device files and `JAX_PLATFORMS`. The `bertjax` command sets up the
process's memory from this before anything heavy is imported (bertjax/__main__.py); multi-host
setup asks whether it runs on a Cloud TPU VM (bertjax.parallel.distributed)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def tpu_chips_present(dev: str = "/dev") -> bool:
  """Cloud TPU chips as device files: v2-v4 /dev/accel*, v5e and later /dev/vfio/N."""
  root = Path(dev)
  return (root / "accel0").exists() or any((root / "vfio").glob("[0-9]*"))


def _nvidia_gpus_present(dev: str) -> bool:
  return any(Path(dev).glob("nvidia[0-9]*"))


def _amd_gpus_present(dev: str) -> bool:
  return (Path(dev) / "kfd").exists()


def gpus_present(dev: str = "/dev") -> bool:
  """GPUs as device files: NVIDIA /dev/nvidiaN, AMD (ROCm) /dev/kfd."""
  return _nvidia_gpus_present(dev) or _amd_gpus_present(dev)


def first_platform(environ: Mapping[str, str] | None = None) -> str:
  """The platform `JAX_PLATFORMS` names first (JAX's default), "" where it names none."""
  environ = os.environ if environ is None else environ
  return environ.get("JAX_PLATFORMS", "").split(",")[0].strip()


def cpu_platform_forced(environ: Mapping[str, str] | None = None) -> bool:
  """`JAX_PLATFORMS` makes the CPU JAX's default platform (the first one it names)."""
  return first_platform(environ) == "cpu"


def computes_on_cpu(environ: Mapping[str, str] | None = None, dev: str = "/dev") -> bool:
  """Whether JAX's default platform here will be the CPU: `JAX_PLATFORMS` names it first, or
  names nothing and the host has no TPU or GPU device files."""
  named = first_platform(environ)
  if named:
    return named == "cpu"
  return not (tpu_chips_present(dev) or gpus_present(dev))


def computes_on_gpu(environ: Mapping[str, str] | None = None, dev: str = "/dev") -> bool:
  """Whether JAX's default platform here will be a GPU: `JAX_PLATFORMS` names cuda, gpu or
  rocm first, or names nothing and the host has GPU device files and no TPU's."""
  named = first_platform(environ)
  if named:
    return named in ("cuda", "gpu", "rocm")
  return gpus_present(dev) and not tpu_chips_present(dev)


def accelerator_platform(dev: str = "/dev") -> str | None:
  """The JAX platform of this host's accelerator from its device files: "tpu", "cuda" (NVIDIA),
  "rocm" (AMD), or None."""
  if tpu_chips_present(dev):
    return "tpu"
  if _nvidia_gpus_present(dev):
    return "cuda"
  return "rocm" if _amd_gpus_present(dev) else None
