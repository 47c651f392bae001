"""The encoder-decoders (T5, BART) in generation: the encoder run once, the decoder's KV cache
(self-attention slots and the cross-attention's keys and values) made and stepped; the decoding
loops (greedy, sampling, beam search) are bertjax/inference/generate.py's.

A source is (ids [R, S], mask [R, S]: 1 = a token, 0 = padding); every row's decoder starts from
the one start token (T5's <pad>, BART's </s>), so the decoder's rows need no padding.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from bertjax.data.tokenizers import special_ids
from bertjax.models import ModelConfig, build_model

Array = jax.Array
Source = tuple[Array, Array]


@dataclasses.dataclass(frozen=True)
class Specials:
  """An encoder-decoder tokenizer's frame: `bos` (BART's <s>; None for T5) and `eos` around a
  text, `pad`, and the decoder's start token (transformers' decoder_start_token_id)."""

  bos: int | None
  eos: int
  pad: int
  start: int

  def wrap(self, ids: Sequence[int], length: int | None = None) -> tuple[list[int], bool]:
    """`ids` between bos and eos, cut on the right to `length` tokens (None: uncut); and
    whether cut."""
    room = len(ids) if length is None else max(0, length - 1 - (self.bos is not None))
    head = [self.bos] if self.bos is not None else []
    return head + list(ids[:room]) + [self.eos], len(ids) > room


def specials(tokenizer: Any) -> Specials:
  """The frame of a t5- or bart-style tokenizer (a ValueError for any other)."""
  ids = special_ids(tokenizer)
  if ids.get("eos") is None or ids.get("pad") is None:
    raise ValueError("an encoder-decoder needs its t5- or bart-style tokenizer (with </s> and "
                     "<pad>): bertjax tokenizer train --style t5 (or bart)")
  bos = ids.get("bos")
  return Specials(bos, ids["eos"], ids["pad"], ids["pad"] if bos is None else ids["eos"])


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
