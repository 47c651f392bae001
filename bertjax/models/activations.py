"""The activation functions of the MLPs and heads, by their config names
(`ModelConfig.activation`): "gelu" the exact erf form (Hugging Face "gelu"), "gelu_tanh" the
tanh approximation (google-research/bert's TF code, GPT-2; Hugging Face "gelu_new"), "relu",
"silu"."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np

Array = jax.Array


def gelu_exact(x: Array) -> Array:
  """GELU in torch's exact form, x·(1 + erf(x/√2))/2. jax.nn.gelu(approximate=False) is the
  same function through erfc, which XLA expands into both of its branches with an exponential
  and divisions: twice the time forward on a CPU
  (docs/results/2026-11-27-unrolled-layers-cpu.md)."""
  return 0.5 * x * (1 + jax.lax.erf(x * np.sqrt(0.5).astype(x.dtype)))


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": gelu_exact,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def activation_fn(name: str) -> Callable[[Array], Array]:
  """The activation `ModelConfig.activation` names."""
  return ACTIVATIONS[name]
