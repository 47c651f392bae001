"""LoRA (Hu et al. 2021) inside the einsum `Dense` of bertjax/models/layers.py: where each
target sits in a layer, the parameter names, A's initialiser, and the update (alpha / r)·x A B.

The update's parameters (`lora_a*`/`lora_b*`) and its input dropout are created in the Dense
they update, so that they scan and shard like its kernel.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import precision
from bertjax.models.config import ModelConfig
from bertjax.models.dropout import Dropout

Array = jax.Array

# Where each LoRA target sits in a layer: (module path inside a Block, the index of its slice
# along the kernel's first output axis or None for the whole kernel). BERT's query, key and
# value are the slices of the fused qkv kernel [D, 3, N, H], in that order.
LORA_SITES: dict[str, tuple[tuple[str, ...], int | None]] = {
    "query": (("attention", "qkv"), 0), "key": (("attention", "qkv"), 1),
    "value": (("attention", "qkv"), 2), "qkv": (("attention", "qkv"), None),
    "out": (("attention", "out"), None), "wi": (("mlp", "wi"), None),
    "wo": (("mlp", "wo"), None)}


def lora_param_names(target: str) -> tuple[str, str]:
  """The (A, B) parameter names of a LoRA target inside its Dense: `lora_a`/`lora_b` for a
  whole kernel, `lora_a_query`/`lora_b_query` for a slice of the fused one."""
  sliced = LORA_SITES[target][1] is not None
  return (f"lora_a_{target}", f"lora_b_{target}") if sliced else ("lora_a", "lora_b")


def lora_updates(config: ModelConfig, site: tuple[str, ...]) -> tuple[tuple[str, int | None],
                                                                       ...]:
  """The (target, slice) LoRA updates `config` puts on the Dense at `site`."""
  return tuple((t, LORA_SITES[t][1]) for t in config.lora_modules if LORA_SITES[t][0] == site)


def lora_a_init(key: Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Array:
  """peft's A: kaiming-uniform with a = sqrt(5) (nn.Linear's default), i.e. U(-b, b) with
  b = 1/sqrt(fan_in); A is [*in, r], so fan_in is the product of all but the last axis."""
  fan_in = 1
  for size in shape[:-1]:
    fan_in *= size
  bound = 1.0 / fan_in ** 0.5
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def lora_delta(module: nn.Module, config: ModelConfig, x: Array, equation: str,
               kernel_shape: tuple[int, ...], kernel_axes: tuple[str | None, ...],
               updates: tuple[tuple[str, int | None], ...], deterministic: bool) -> Array:
  """(alpha / r) · dropout(x) A B in the layout of the einsum's output: A [*in, r] and B
  [r, *out] (a slice's B without the sliced axis; untargeted slices get zeros).

  Called from the compact `__call__` of `module`, the Dense computing
  `einsum(equation, x, kernel)` with `kernel_shape`/`kernel_axes`, which holds the parameters
  and the dropout; `updates` are its (target, slice) pairs and `deterministic` turns the
  dropout off."""
  x_sub, rest = equation.split(",")
  k_sub, y_sub = rest.split("->")
  n_in = sum(c in x_sub for c in k_sub)
  in_sub, out_sub = k_sub[:n_in], k_sub[n_in:]
  if any(c in x_sub for c in out_sub):
    raise ValueError(f"LoRA needs the kernel's input axes first, got {equation!r}")
  r = next(c for c in "rzyxwvutsq" if c not in equation)
  batch_sub = "".join(c for c in x_sub if c not in k_sub)
  rank = config.lora_rank
  x = Dropout(config.lora_dropout, config.dropout_rng, name="lora_dropout")(
      x, deterministic=deterministic)
  in_shape, in_axes = kernel_shape[:n_in], kernel_axes[:n_in]
  out_shape, out_axes = kernel_shape[n_in:], kernel_axes[n_in:]
  slices: dict[int, Array] = {}
  whole = None
  for target, index in updates:
    a_name, b_name = lora_param_names(target)
    sub, b_shape, b_axes = out_sub, out_shape, out_axes
    if index is not None:
      sub, b_shape, b_axes = out_sub[1:], out_shape[1:], out_axes[1:]
    a = module.param(a_name, nn.with_logical_partitioning(lora_a_init, in_axes + (None,)),
                     in_shape + (rank,), config.weight_dtype)
    b = module.param(b_name, nn.with_logical_partitioning(nn.initializers.zeros,
                                                          (None,) + b_axes),
                     (rank,) + b_shape, config.weight_dtype)
    h = (precision.einsum(config, f"{x_sub},{in_sub}{r}->{batch_sub}{r}", x, a)
         * config.lora_scale)
    out = "".join(c for c in y_sub if c in batch_sub + sub)
    delta = precision.einsum(config, f"{batch_sub}{r},{r}{sub}->{out}", h, b)
    if index is None:
      whole = delta
    else:
      slices[index] = delta
  if whole is not None:
    return whole
  # Targeted slices of the fused kernel stacked along its first output axis, zeros between.
  axis = y_sub.index(out_sub[0])
  some = next(iter(slices.values()))
  return jnp.stack([slices.get(i, jnp.zeros_like(some)) for i in range(out_shape[0])],
                   axis=axis)
