"""What the encoder-decoders (T5: bertjax/models/t5.py, BART: bertjax/models/bart.py) share: the
model's call (encode, then decode) and LM head, the decoder's cross-attention over the encoder's
output, and the masks of one batch (padding and packed examples, numbered by segment ids in the
encoder's and the decoder's rows alike). Their MLP is layers.Mlp with `activation_dropout` on its
hidden activations.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import attention, layers
from bertjax.models.config import ModelConfig

Array = jax.Array
Dense = layers.Dense


def valid(like_BS: Array, attention_mask_BS: Array | None, segments_BS: Array | None) -> Array:
  """1 where a position holds a token: the mask, else segment ids > 0, else everywhere."""
  if attention_mask_BS is not None:
    return attention_mask_BS
  if segments_BS is not None:
    return (segments_BS > 0).astype(jnp.int32)
  return jnp.ones(like_BS.shape[:2], jnp.int32)


def encoder_mask(input_ids_BS: Array, attention_mask_BS: Array | None = None,
                 encoder_segments_BS: Array | None = None) -> attention.AttentionMask:
  return attention.encoder_mask(valid(input_ids_BS, attention_mask_BS, encoder_segments_BS),
                                encoder_segments_BS)


def decoder_masks(decoder_length: int, encoded_BSD: Array | None, attention_mask_BS: Array | None,
                  decoder_attention_mask_BL: Array | None, encoder_segments_BS: Array | None,
                  decoder_segments_BL: Array | None, decode: bool = False
                  ) -> tuple[attention.AttentionMask, attention.AttentionMask]:
  """(the decoder's causal self-attention mask, its cross-attention mask). With `decode`
  (generation: the decoder's tokens one step at a time over its KV cache) the self-attention
  mask is all ones, which the attention makes causal by cache slot; the cross-attention mask
  comes from `attention_mask_BS` (the encoder's output may be absent: cached)."""
  if decode:
    if attention_mask_BS is None:
      raise ValueError("decode=True needs attention_mask_BS (the encoder's padding)")
    ones = attention.AttentionMask(jnp.ones((attention_mask_BS.shape[0], 1, 1, 1), bool))
    return ones, attention.cross_mask(decoder_length, attention_mask_BS)
  encoder_valid_BS = valid(encoded_BSD[..., 0], attention_mask_BS, encoder_segments_BS)
  self_mask = attention.decoder_mask(decoder_length, decoder_segments_BL,
                                     decoder_attention_mask_BL)
  cross = attention.cross_mask(decoder_length, encoder_valid_BS, encoder_segments_BS,
                               decoder_segments_BL)
  return self_mask, cross


class CrossAttention(nn.Module):
  """The decoder reading the encoder's output: `query` from the decoder, a fused `kv` [D, 2, N,
  H] from the encoder, `out`; biases where the config has attention biases (BART), scores
  divided by `score_divisor` (None: sqrt(H); T5: 1.0, its query initialisation carries it).

  `decode=True` (generation): the keys and values are computed once, when the encoder's output
  is given, and kept in the "cache" collection (`cross_key`, `cross_value` [B, S, N, H], as
  the self-attention's cache); calls without it read them."""

  config: ModelConfig
  query_init: layers.Initializer
  kv_init: layers.Initializer
  out_init: layers.Initializer
  score_divisor: float | None = None
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x_BLD: Array, encoded_BSD: Array | None,
               mask: attention.AttentionMask) -> Array:
    cfg = self.config
    d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    bias = cfg.attention_bias
    q_BLNH = Dense(cfg, "bld,dnh->blnh", (d, n, h), ("embed", "heads", "kv"),
                   (n, h) if bias else None, ("heads", "kv"), init=self.query_init,
                   name="query")(x_BLD)
    project = Dense(cfg, "bsd,dtnh->bstnh", (d, 2, n, h), ("embed", "qkv", "heads", "kv"),
                    (2, n, h) if bias else None, ("qkv", "heads", "kv"), init=self.kv_init,
                    name="kv")
    if encoded_BSD is not None:
      kv_BS2NH = project(encoded_BSD)
      k_BSNH, v_BSNH = kv_BS2NH[:, :, 0], kv_BS2NH[:, :, 1]
      if self.decode:
        for name, x in (("cross_key", k_BSNH), ("cross_value", v_BSNH)):
          self.variable("cache", name, lambda x=x: x).value = x
    else:  # decoding after the first step: the cached keys and values
      k_BSNH, v_BSNH = (self.variable("cache", name, lambda: None).value
                        for name in ("cross_key", "cross_value"))
    q_BLNH = layers.constrain(q_BLNH, layers.ACT_BLNH)
    # The XLA core: the fused kernels assume queries and keys of one sequence.
    out_BLNH = attention.attend(cfg.replace(attention="xla"), q_BLNH, k_BSNH, v_BSNH, mask,
                                deterministic=self.deterministic,
                                score_divisor=self.score_divisor)
    out_BLNH = layers.constrain(out_BLNH, layers.ACT_BLNH)
    return Dense(cfg, "blnh,nhd->bld", (n, h, d), ("heads", "kv", "embed"),
                 (d,) if bias else None, ("embed",), init=self.out_init, name="out")(out_BLNH)


def run_layers(block: type[nn.Module], config: ModelConfig, decoder: bool, deterministic: bool,
               decode: bool, x_BLD: Array, *broadcast: Any) -> Array:
  """The encoder's or the decoder's `block`s over `x_BLD` (called from a stack's compact
  method, whose children they become): `layers` scanned (parameters and KV cache sliced per
  layer) or `layers_{i}` unrolled, with the config's remat policy; `broadcast`: the arguments
  every layer reads whole (masks, a relative bias, the encoder's output). A block is built as
  `block(config, decoder, deterministic, decode)` and returns `(x, None)`."""
  depth = config.decoder_depth if decoder else config.num_layers
  if config.remat_policy != "none":
    block = nn.remat(block, policy=layers.REMAT_POLICIES[config.remat_policy],
                     prevent_cse=not config.scan_layers)
  if config.scan_layers:
    stack = nn.scan(block, variable_axes={"params": 0, "cache": 0},
                    split_rngs={"params": True, "dropout": True},
                    in_axes=(nn.broadcast,) * len(broadcast), length=depth,
                    metadata_params={nn.PARTITION_NAME: "layers"})
    x_BLD, _ = stack(config, decoder, deterministic, decode, name="layers")(x_BLD, *broadcast)
    return x_BLD
  for i in range(depth):
    x_BLD, _ = block(config, decoder, deterministic, decode, name=f"layers_{i}")(x_BLD,
                                                                                 *broadcast)
  return x_BLD


class EncoderDecoder(nn.Module):
  """An encoder-decoder's call: `encode` the encoder's tokens, `decode` the decoder's against
  them (T5 and BART define both); `lm_logits` is their head, tied to the token table."""

  config: ModelConfig

  def lm_logits(self, table: layers.Embed, x_BLD: Array) -> Array:
    """Next-token logits [B, L, V] in float32 from the decoder's final states."""
    logits_BLV = layers.tied_logits(self.config, table, x_BLD)
    return layers.constrain(logits_BLV, ("batch", "length", "vocab")).astype(jnp.float32)

  def __call__(self, input_ids_BS: Array, decoder_input_ids_BL: Array,
               attention_mask_BS: Array | None = None,
               decoder_attention_mask_BL: Array | None = None,
               encoder_segments_BS: Array | None = None, decoder_segments_BL: Array | None = None,
               deterministic: bool = True) -> Array:
    encoded_BSD = self.encode(input_ids_BS, attention_mask_BS, encoder_segments_BS,
                              deterministic)
    return self.decode(decoder_input_ids_BL, encoded_BSD, attention_mask_BS,
                       decoder_attention_mask_BL, encoder_segments_BS, decoder_segments_BL,
                       deterministic)


def layer_stacks(config: ModelConfig) -> list[tuple[tuple[str, ...], int]]:
  """An encoder-decoder's two layer stacks: the encoder's and the decoder's."""
  return [(("encoder",), config.num_layers), (("decoder",), config.decoder_depth)]
