"""Model registry: build a Flax module from a ModelConfig, initialise it, count its parameters.

Counts by group and the check against the papers' figures (`bertjax info`) are reporting, in
bertjax/tools/param_report.py.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import bart, encoder, families, gpt, t5
from bertjax.models.bart import Bart
from bertjax.models.bert import BertForPreTraining, BertForSequenceClassification, BertModel
from bertjax.models.config import ModelConfig
from bertjax.models.gpt import GPT
from bertjax.models.t5 import T5

__all__ = ["ModelConfig", "BertModel", "BertForPreTraining", "BertForSequenceClassification",
           "GPT", "T5", "Bart", "build_model", "init_params", "jit_init", "abstract_params"]

# The built-in families, one line each; others register from outside (bertjax.models.families).
families.register(encoder.FAMILY)
families.register(gpt.FAMILY)
families.register(t5.FAMILY)
families.register(bart.FAMILY)

# A head a model can carry (its family's `heads`); the names are also those of the Hugging Face
# export's head.
Head = str


def build_model(config: ModelConfig, head: Head = "pretraining") -> nn.Module:
  """The module a config trains: its family's model with `head` (bertjax/models/families.py).
  An encoder-decoder's or a decoder's one head, the tied LM head, serves pre-training and
  fine-tuning alike."""
  family = config.family_record
  if head not in family.heads:
    raise ValueError(f"a {config.family} model has the heads {', '.join(family.heads)}, not "
                     f"{head!r}")
  return family.build(config, head)


def example_inputs(config: ModelConfig, batch: int = 1, length: int | None = None) -> tuple:
  """Dummy positional inputs with which `model.init` traces the shapes of every parameter."""
  length = min(config.max_positions, 8) if length is None else length
  ids = jnp.zeros((batch, length), jnp.int32)
  return (ids, ids) if config.is_encoder_decoder else (ids,)


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
