"""The encoder-decoders (T5, BART) in generation: the encoder run once, the decoder's KV cache
(self-attention slots and the cross-attention's keys and values) made and stepped; the decoding
loops (greedy, sampling, beam search) are bertjax/inference/generate.py's.

A source is (ids [R, S], mask [R, S]: 1 = a token, 0 = padding); every row's decoder starts from
the one start token (T5's <pad>, BART's </s>), so the decoder's rows need no padding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from bertjax.models import ModelConfig, build_model

Array = jax.Array
Source = tuple[Array, Array]


def _model(config: ModelConfig) -> Any:
  return build_model(config.replace(remat_policy="none", hidden_dropout=0.0,
                                    attention_dropout=0.0, activation_dropout=0.0))


def _cache(config: ModelConfig, rows: int, slots: int, source_length: int) -> Any:
  """An empty cache for `rows` decoders of `slots` tokens reading `source_length` encoder
  positions."""
  model = _model(config)
  ids = jnp.zeros((rows, slots), jnp.int32)
  encoded = jnp.zeros((rows, source_length, config.hidden_size), jnp.float32)
  mask = jnp.ones((rows, source_length), jnp.int32)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, encoded, mask,
                                             decode=True, method="decode"))
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def prefill(params: Any, config: ModelConfig, ids_RP: Array, total: int,
            source: Source) -> tuple[Array, Any]:
  """The sources encoded, the decoder's cache made for `total` slots (the cross-attention's
  keys and values written) and the decoder's first tokens `ids_RP` run: (logits at the last
  of them [R, V], the cache)."""
  model = _model(config)
  source_ids, source_mask = source
  encoded = model.apply({"params": params}, source_ids, source_mask, method="encode")
  cache = _cache(config, ids_RP.shape[0], total, source_ids.shape[1])
  logits, variables = model.apply({"params": params, "cache": cache}, ids_RP, encoded,
                                  source_mask, decode=True, method="decode", mutable=["cache"])
  return logits[:, -1], variables["cache"]


def step(params: Any, config: ModelConfig, cache: Any, ids_RL: Array,
         source: Source) -> tuple[Array, Any]:
  """The next L tokens of each row through the decoder's cache: logits [R, L, V], the cache."""
  logits, variables = _model(config).apply(
      {"params": params, "cache": cache}, ids_RL, None, source[1], decode=True,
      method="decode", mutable=["cache"])
  return logits, variables["cache"]
