"""What a config's "auto" settings become on the backend a run computes on: decided once when
the run starts, said in its first lines and its summary, and written into the run's config.json
and its checkpoints' configs. A resume keeps what the run started with (`resolve`'s `recorded`,
read from the checkpoint it resumes from), whatever this machine would decide today.

`model.dtype="auto"`: bf16 compute on TPUs and GPUs; on a CPU only where its bf16 matmuls are
measured at least `BF16_OVER_FP32` times as fast as float32's. `model.attention="auto"` is made
concrete by the Trainer for the platform it compiles for (`attention.choose`).

The guide: docs/performance.md, 'Defaults per backend'.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import ml_collections

from bertjax.models.config import AUTO
from bertjax.parallel import distributed
from bertjax.training import flops

log = logging.getLogger(__name__)

# bf16 products this many times float32's on a CPU make bf16 its compute dtype: between the
# readings of a CPU without native bf16 and one with AVX-512 BF16, far from both
# (docs/results/2026-11-28-auto-dtype-cpu.md). Without native bf16 products (no AVX-512 BF16 or
# AMX) XLA computes them in float32 and the step also pays the conversions, so a bf16 step is
# slower than a float32 one there.
BF16_OVER_FP32 = 1.5
# Why a resumed run's "auto" setting has the value it has.
RECORDED_REASON = "as resolved when the run started, its checkpoint's value"
# Platforms whose matrix units compute in bf16 at full rate.
_BF16_NATIVE = ("tpu", "gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class Choice:
  """One "auto" setting made concrete: the key, its value here, and why."""
  key: str
  value: str
  reason: str

  def line(self) -> str:
    return f"{self.key}={self.value} (auto: {self.reason})"


def cpu_bf16_speedup(pairs: int = 3) -> float:
  """How many times float32's rate this CPU's bf16 matmuls run at: the median of `pairs`
  ratios, each of a bf16 probe and a float32 one taken one after the other (`flops.
  measure_matmul_peak`, each dtype in its fastest form). Read side by side, not from the peak
  cache: load slows both probes of a pair alike, and an entry that moved (one mis-timed log
  interval once raised the float32 one 2.6x) would move the dtype of every later run."""
  size = flops.CPU_PROBE_SIZE
  ratios = [flops.measure_matmul_peak(size, jnp.bfloat16, flops.CPU_PROBE_REPEATS)
            / flops.measure_matmul_peak(size, jnp.float32, flops.CPU_PROBE_REPEATS)
            for _ in range(pairs)]
  return statistics.median(ratios)


def compute_dtype(platform: str, speedup: Callable[[], float] | None = None,
                  agree: Callable[[bool], bool] | None = None) -> Choice:
  """`model.dtype` for "auto" on `platform`. `speedup`: the CPU's bf16 matmul rate over
  float32's (default `cpu_bf16_speedup`); `agree(bf16)`: whether every process of the run chose
  bf16 (each process probes its own host; all must compile the same program), default: this
  process alone."""
  if platform in _BF16_NATIVE:
    return Choice("model.dtype", "bfloat16", f"{platform}: bf16 matrix units")
  ratio = (speedup or cpu_bf16_speedup)()
  bf16 = ratio >= BF16_OVER_FP32
  if agree is not None:
    bf16 = agree(bf16)
  measured = f"bf16 matmuls {ratio:.2f}x float32's on this CPU"
  if bf16:
    return Choice("model.dtype", "bfloat16", measured)
  if ratio < BF16_OVER_FP32:
    return Choice("model.dtype", "float32",
                  f"{measured}, under {BF16_OVER_FP32}x: no native bf16 products")
  return Choice("model.dtype", "float32",
                f"{measured}, but under {BF16_OVER_FP32}x on another host of the run")


def auto_keys(config: ml_collections.ConfigDict) -> list[str]:
  """The keys of `config` that a run resolves when it starts (`resolve`)."""
  return ["model.dtype"] if config.model.dtype == AUTO else []


def resolve(config: ml_collections.ConfigDict, platform: str, *,
            speedup: Callable[[], float] | None = None,
            agree: Callable[[bool], bool] | None = None,
            recorded: Mapping[str, str] | None = None
            ) -> tuple[ml_collections.ConfigDict, list[Choice]]:
  """`config` with its "auto" settings made concrete for `platform` (a copy; `config` itself
  when there is nothing to resolve), and the choices made. `recorded`: what a resumed run's
  settings were resolved to when it started (its checkpoint's values, by key): an "auto"
  setting found there keeps that value, unprobed, so a resume continues the program it
  checkpointed whatever this machine would decide today."""
  choices = []
  if config.model.dtype == AUTO:
    kept = (recorded or {}).get("model.dtype", AUTO)
    choices.append(compute_dtype(platform, speedup, agree) if kept == AUTO else
                   Choice("model.dtype", kept, RECORDED_REASON))
  if not choices:
    return config, []
  config = ml_collections.ConfigDict(config.to_dict())
  for choice in choices:
    group, name = choice.key.split(".")
    config[group][name] = choice.value
  return config, choices


def all_processes_agree(flag: bool) -> bool:
  """True where every process of the run says True (one small all-gather)."""
  return not distributed.any_process(not flag)
