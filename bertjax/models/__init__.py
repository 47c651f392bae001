"""Model registry: build a Flax module from a ModelConfig, initialise it, count its parameters.

Counts by group and the check against the papers' figures (`bertjax info`) are reporting, in
bertjax/tools/param_report.py.
"""

from __future__ import annotations

from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from bertjax.models.bert import BertForPreTraining, BertForSequenceClassification, BertModel
from bertjax.models.config import ModelConfig
from bertjax.models.gpt import GPT

__all__ = ["ModelConfig", "BertModel", "BertForPreTraining", "BertForSequenceClassification",
           "GPT", "build_model", "init_params", "jit_init", "abstract_params", "count_params",
           "unstack_layers", "stack_layers", "unscanned"]

Head = Literal["pretraining", "classification"]


def build_model(config: ModelConfig, head: Head = "pretraining") -> nn.Module:
  """The module a config trains: BERT with pre-training or classification heads, or GPT."""
  if config.family == "gpt":
    return GPT(config)
  if head == "classification":
    return BertForSequenceClassification(config)
  return BertForPreTraining(config)


def example_inputs(config: ModelConfig, batch: int = 1, length: int | None = None) -> tuple:
  """Dummy positional inputs with which `model.init` traces the shapes of every parameter."""
  length = min(config.max_positions, 8) if length is None else length
  ids = jnp.zeros((batch, length), jnp.int32)
  return (ids,)


def init_params(model: nn.Module, rng: jax.Array, batch: int = 1,
                length: int | None = None) -> Any:
  """Boxed (logically partitioned) parameters; see sharding.sharded_init for the sharded path."""
  return model.init(rng, *example_inputs(model.config, batch, length))["params"]


def init_compiler_options() -> dict[str, Any] | None:
  """XLA options for programs that run once, such as initialisation.

  On CPU, LLVM's optimisation of the RNG-heavy init program costs seconds (5.6 s -> 1.4 s
  for a 2-layer model here) and buys nothing for a program that runs once.
  """
  return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None


def jit_init(model: nn.Module) -> Any:
  """Unboxed parameters from a jitted init (unsharded; see sharding.sharded_init)."""
  init = jax.jit(lambda rng: nn.meta.unbox(init_params(model, rng)),
                 compiler_options=init_compiler_options())
  return init


def abstract_params(model: nn.Module) -> Any:
  """Parameter shapes/dtypes and logical axes without allocating (jax.eval_shape)."""
  return jax.eval_shape(lambda rng: init_params(model, rng), jax.random.key(0))


def count_params(params: Any) -> int:
  leaves = jax.tree.leaves(nn.meta.unbox(params))
  return int(sum(np.prod(leaf.shape) for leaf in leaves))


# --- scanned <-> per-layer parameter layouts ----------------------------------------------
# Flat dicts keyed by parameter path. Scanned models keep one `layers` entry per parameter
# with a leading layer axis; unrolled ones `layers_0`, `layers_1`, ... (Hugging Face's order).

Flat = dict[tuple[str, ...], Any]


def _stack_prefix(cfg: ModelConfig) -> tuple[str, ...]:
  return ("bert", "encoder") if cfg.family == "bert" else ("decoder",)


def unstack_layers(flat: Flat, cfg: ModelConfig) -> Flat:
  """Scanned layout (`layers` with a leading layer axis) -> `layers_{i}` entries."""
  if not cfg.scan_layers:
    return dict(flat)
  prefix = _stack_prefix(cfg)
  out: Flat = {}
  for key, value in flat.items():
    if key[:len(prefix) + 1] == prefix + ("layers",):
      for i in range(cfg.num_layers):
        out[prefix + (f"layers_{i}",) + key[len(prefix) + 1:]] = value[i]
    else:
      out[key] = value
  return out


def stack_layers(flat: Flat, cfg: ModelConfig) -> Flat:
  """`layers_{i}` entries -> the scanned layout, when the config scans layers."""
  if not cfg.scan_layers:
    return dict(flat)
  prefix = _stack_prefix(cfg)
  out: Flat = {}
  grouped: dict[tuple[str, ...], list[Any]] = {}
  for key, value in flat.items():
    if key[:len(prefix)] == prefix and key[len(prefix)].startswith("layers_"):
      i = int(key[len(prefix)].split("_")[1])
      grouped.setdefault(key[len(prefix) + 1:], [None] * cfg.num_layers)[i] = value
    else:
      out[key] = value
  for rest, values in grouped.items():
    out[prefix + ("layers",) + rest] = np.stack(values)
  return out


def unscanned(params: Any, cfg: ModelConfig) -> tuple[Any, ModelConfig]:
  """The same weights laid out for an unrolled layer stack, and its config.

  Decoding wants unrolled layers: under nn.scan the KV cache is a scanned carry, copied
  whole through the scan at every new token (docs/generation.md measures the difference).
  """
  if not cfg.scan_layers:
    return params, cfg
  flat = unstack_layers(traverse_util.flatten_dict(nn.meta.unbox(params)), cfg)
  return traverse_util.unflatten_dict(flat), cfg.replace(scan_layers=False)
