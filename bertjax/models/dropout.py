"""Dropout whose random bits cost a few integer operations per element.

The default (`rng="hash"`) is a counter-based hash: a 64-bit seed from the layer's key (one
threefry call per tensor) and the murmur3 finaliser applied to each element's global index, so
the mask is the same however the tensor is sharded. `rng="threefry"` keeps
`flax.linen.Dropout`'s `jax.random.bernoulli` (and so follows `jax_default_prng_impl`, e.g.
`rbg` on TPU).

The guide: docs/models.md, 'Dropout'; why: docs/performance.md, 'Where a CPU step's time
goes'.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models.config import DropoutRng

_UINT32_LIMIT = 2**32


def _fmix32(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser: a bijection on uint32 with full avalanche."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _linear_index(shape: tuple[int, ...], axes: range) -> jax.Array:
  """Row-major index over `axes` of `shape`, broadcast to `shape` (uint32)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(axes):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
    stride *= shape[axis]
  return index


# Why a hash: `jax.random.bernoulli` is one threefry-2x32 evaluation (20 rounds) per element, the
# largest elementwise cost of a step on attention probabilities (GPT-2 small at 1,024 tokens:
# 302 M draws per step; dropout 17.5% of its CPU op time in
# docs/results/2026-11-23-cpu-fp32-profiles.md). Dropout needs independent-looking Bernoulli
# bits, not a cryptographic stream.
def hash_keep_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
  """A boolean mask, True with probability 1 - rate independently per element.

  The index splits into the last two axes ("inner": within one attention map or one
  sequence's activations) and the leading ones ("outer"); each is hashed with half of the
  seed and the two are hashed together. Within one outer row every element's bits are
  distinct (a bijection of the inner index); across rows they collide only at random.
  """
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
  split = max(len(shape) - 2, 0)
  for part in (shape[:split], shape[split:]):
    if math.prod(part) >= _UINT32_LIMIT:
      raise ValueError(f"hash dropout indexes with 32 bits per part; shape {shape} has a part "
                       f"{part} of {math.prod(part)} elements (use model.dropout_rng=threefry)")
  seed = jax.random.bits(key, (2,), jnp.uint32)
  inner = _fmix32(_linear_index(shape, range(split, len(shape))) ^ seed[1])
  outer = _fmix32(_linear_index(shape, range(split)) ^ seed[0])
  bits = _fmix32(inner + outer)
  # P(bits >= t) = 1 - t / 2**32; t rounded to the nearest integer (error < 2.4e-10).
  threshold = min(round(rate * _UINT32_LIMIT), _UINT32_LIMIT - 1)
  return bits >= jnp.uint32(threshold)


class Dropout(nn.Module):
  """Inverted dropout (kept elements scaled by 1 / (1 - rate)), like `flax.linen.Dropout`."""

  rate: float
  rng: DropoutRng = "hash"
  rng_collection: str = "dropout"

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    if deterministic or self.rate == 0.0:
      return x
    if self.rate == 1.0:
      return jnp.zeros_like(x)
    key = self.make_rng(self.rng_collection)
    if self.rng == "hash":
      keep = hash_keep_mask(key, x.shape, self.rate)
    elif self.rng == "threefry":
      keep = jax.random.bernoulli(key, 1.0 - self.rate, x.shape)
    else:
      raise ValueError(f"model.dropout_rng must be 'hash' or 'threefry', got {self.rng!r}")
    return jax.lax.select(keep, x / jnp.asarray(1.0 - self.rate, x.dtype), jnp.zeros_like(x))
