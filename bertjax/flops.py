"""Model FLOPs per training step and device peaks, for MFU.

Model FLOPs count the work the model needs, not what the program happens to do
(PaLM, App. B): per training token 6·N for the layer stack's matmul parameters, plus
attention's 12·layers·seq·width (QKᵀ and AV, forward and backward, no causal halving), plus
6·vocab·width for each position whose vocabulary projection is computed (MLM: the gathered
positions only; GPT: every position), plus BERT's small heads. Rematerialisation adds hardware
FLOPs, never model FLOPs. tests/test_bench.py holds the formula to the dots XLA compiles.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from bertjax.models import ModelConfig

# Dense bf16 peak FLOP/s per chip (per GPU), from the vendors' data sheets.
PEAK_FLOPS_BY_DEVICE_KIND = {
    "TPU v2": 45e12, "TPU v3": 123e12, "TPU v4": 275e12, "TPU v5 lite": 197e12,
    "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v6 lite": 918e12,
    "TPU v6e": 918e12, "NVIDIA A100": 312e12, "NVIDIA H100": 989e12, "NVIDIA H200": 989e12,
}


def matmul_params(cfg: ModelConfig) -> int:
  """Parameters of the layer stack that take part in a matmul per token (QKV and output
  projections, MLP in and out), excluding embedding tables and heads."""
  d, f = cfg.hidden_size, cfg.mlp_dim
  return cfg.num_layers * (4 * d * d + 2 * d * f)


def train_flops_per_step(cfg: ModelConfig, batch_size: int, seq_length: int,
                         predictions_per_seq: int | None = None) -> float:
  """Model FLOPs of one training step (forward + backward) of `batch_size` sequences.

  predictions_per_seq: positions per sequence that reach the MLM / LM head (BERT's
  max_predictions with gathered positions); None means every position (GPT, or MLM logits
  everywhere). BERT's heads: the MLM transform (width² per predicted position), the pooler
  (width² per sequence) and the 2-way NSP classifier.
  """
  d = cfg.hidden_size
  tokens = batch_size * seq_length
  predicted = batch_size * (seq_length if predictions_per_seq is None else predictions_per_seq)
  dense = 6 * matmul_params(cfg) * tokens
  attention = 12 * cfg.num_layers * seq_length * d * tokens
  vocab = 6 * cfg.vocab_size * d * predicted
  heads = 0
  if cfg.family == "bert":
    heads = 6 * d * d * predicted + 6 * (d * d + 2 * d) * batch_size
  return float(dense + attention + vocab + heads)


def device_peak_flops(device: jax.Device) -> float | None:
  """Nominal peak of an accelerator, or None when the kind is not in the table (CPU)."""
  kind = device.device_kind
  for name, peak in sorted(PEAK_FLOPS_BY_DEVICE_KIND.items(), key=lambda kv: -len(kv[0])):
    if kind.startswith(name) or name in kind:
      return peak
  return None


def measure_matmul_peak(size: int = 1024, dtype=jnp.float32, repeats: int = 5) -> float:
  """FLOP/s of a square matmul on the default device: the best of `repeats` timed runs.

  Used as the CPU's peak (no data sheet applies) and as the in-process reference for MFU.
  """
  a = jnp.ones((size, size), dtype)
  b = jnp.ones((size, size), dtype)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, b).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size ** 3 / best


def peak_flops_per_device() -> tuple[float, str]:
  """(peak FLOP/s of one device, where the number comes from)."""
  device = jax.local_devices()[0]
  nominal = device_peak_flops(device)
  if nominal is not None:
    return nominal, f"{device.device_kind} data sheet (bf16 dense)"
  return measure_matmul_peak(), f"measured fp32 1024² matmul on {device.device_kind}"
