"""Position encodings computed inside attention: rotary (RoPE) on queries and keys, and ALiBi's
per-head distance penalty on the scores. Functions of the config and arrays only.

Shape suffixes in names: B batch, L (query) length, S (key) length, N heads, H head dim,
K rotary frequencies (H / 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.models.config import ModelConfig

Array = jax.Array


def rotary_frequencies(config: ModelConfig, theta: float) -> np.ndarray:
  """RoPE's inverse frequencies 1 / theta^(2i / H), i < H/2, in float32 (Hugging Face's
  default rope parameters)."""
  h = config.head_dim
  return (1.0 / (np.float32(theta) ** (np.arange(0, h, 2, dtype=np.float32) / np.float32(h)))
          ).astype(np.float32)


def apply_rotary(x_BLNH: Array, positions_BL: Array, inv_freq_K: Array) -> Array:
  """Rotary position embedding in Hugging Face's rotate-half layout: the first and second
  halves of each head's features are the two coordinates of each rotated pair. In float32."""
  freqs_BLK = positions_BL.astype(jnp.float32)[..., None] * inv_freq_K[None, None, :]
  angles_BL1H = jnp.concatenate([freqs_BLK, freqs_BLK], axis=-1)[:, :, None, :]
  x = x_BLNH.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * jnp.cos(angles_BL1H) + rotated * jnp.sin(angles_BL1H)).astype(x_BLNH.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi's per-head slopes (Press et al. 2022, as MosaicBERT): the geometric sequence
  2^(-8/n), 2^(-16/n), ... for n a power of two; otherwise those of the nearest lower power
  of two followed by every other slope of the next one."""
  def power_of_two(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]
  lower = 2 ** int(np.floor(np.log2(num_heads)))
  slopes = power_of_two(lower)
  if lower < num_heads:
    slopes += power_of_two(2 * lower)[0::2][:num_heads - lower]
  return np.asarray(slopes, np.float32)


def alibi_bias(config: ModelConfig, positions_BL: Array) -> Array:
  """-slope_n |pos_l - pos_s|: the symmetric ALiBi penalty of a bidirectional encoder,
  [B, N, L, S] in float32."""
  pos = positions_BL.astype(jnp.float32)
  distance_B1LS = jnp.abs(pos[:, None, :, None] - pos[:, None, None, :])
  return -jnp.asarray(alibi_slopes(config.num_heads))[None, :, None, None] * distance_B1LS
