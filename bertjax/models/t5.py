"""T5 (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
Text-to-Text Transformer"): an encoder and a decoder with cross-attention, pre-LN with RMS norms
and no biases, a learned bias per head and bucket of relative distance instead of a position
table; T5 1.0 (ReLU MLP, scaled decoder output) and T5 1.1 (gated GeLU). Numerically identical
to `transformers`' T5ForConditionalGeneration / T5EncoderModel given the same weights, padding
and packed examples included (tests/test_t5.py).

The guide: docs/models.md, 'T5 and BART: encoder-decoders'.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bertjax.models import attention, encoder_decoder, layers, precision
from bertjax.models.config import ModelConfig
from bertjax.models.dropout import Dropout
from bertjax.models.families import Family

Array = jax.Array
Dense = layers.Dense


def relative_buckets(relative_LS: Array, bidirectional: bool, num_buckets: int,
                     max_distance: int) -> Array:
  """T5's bucket of each key-minus-query distance: exact below half the buckets (of each
  direction, in the encoder), then logarithmic up to `max_distance`, the last bucket beyond.
  The logarithm in float32 as transformers computes it, so that bucket edges agree."""
  buckets = jnp.zeros_like(relative_LS)
  if bidirectional:
    num_buckets //= 2
    buckets = buckets + (relative_LS > 0).astype(relative_LS.dtype) * num_buckets
    distance = jnp.abs(relative_LS)
  else:
    distance = -jnp.minimum(relative_LS, 0)
  max_exact = num_buckets // 2
  ratio = jnp.maximum(distance, 1).astype(jnp.float32) / np.float32(max_exact)
  scaled = (jnp.log(ratio) / np.float32(math.log(max_distance / max_exact))
            * np.float32(num_buckets - max_exact))
  large = jnp.minimum(max_exact + scaled.astype(relative_LS.dtype), num_buckets - 1)
  return buckets + jnp.where(distance < max_exact, distance, large)


def _init(config: ModelConfig, fan_in: int) -> layers.Initializer:
  """Mesh TensorFlow's: normal, std initializer_range / sqrt(fan-in)."""
  return layers.kernel_init(config, config.initializer_range * fan_in ** -0.5)


def _query_init(config: ModelConfig) -> layers.Initializer:
  """The query's: fan-in hidden_size * head_dim (1/sqrt(H) of the scores folded in)."""
  return _init(config, config.hidden_size * config.head_dim)


def rms_norm(config: ModelConfig, name: str) -> nn.RMSNorm:
  """T5's layer norm: a scale, no shift, no mean subtracted; statistics in float32."""
  return nn.RMSNorm(epsilon=config.layer_norm_eps, dtype=precision.activation_dtype(config),
                    param_dtype=config.weight_dtype,
                    scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                    name=name)


class RelativeBias(nn.Module):
  """The learned bias of each head and distance bucket, [1, N, L, S] for queries at
  `query_offset` + 0..L-1 and keys at 0..S-1 (T5's first layer holds it; all layers add it)."""

  config: ModelConfig
  bidirectional: bool

  @nn.compact
  def __call__(self, query_length: int, key_length: int,
               query_offset: int | Array = 0) -> Array:
    cfg = self.config
    table_KN = self.param(
        "embedding", nn.with_logical_partitioning(_init(cfg, cfg.hidden_size), (None, "heads")),
        (cfg.relative_attention_buckets, cfg.num_heads), cfg.weight_dtype)
    relative_LS = (jnp.arange(key_length)[None, :]
                   - (jnp.arange(query_length)[:, None] + query_offset))
    bucket_LS = relative_buckets(relative_LS, self.bidirectional, cfg.relative_attention_buckets,
                                 cfg.relative_attention_max_distance)
    bias_LSN = jnp.take(table_KN.astype(jnp.float32), bucket_LS, axis=0)
    return jnp.transpose(bias_LSN, (2, 0, 1))[None]


class SelfAttention(nn.Module):
  """Multi-head self-attention without biases or score scaling (the relative bias added), its
  q, k, v fused into one kernel as the other models'. `decode=True`: the decoder's KV cache,
  as the other models' (attention.kv_cache)."""

  config: ModelConfig
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x_BLD: Array, mask: attention.AttentionMask, bias_1NLS: Array) -> Array:
    cfg = self.config
    d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    init_q, init_kv = _query_init(cfg), _init(cfg, d)

    # The query's initialiser differs from the key's and value's: one kernel, set by slices.
    def init_qkv(rng: Array, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> Array:
      q_rng, kv_rng = jax.random.split(rng)
      q = init_q(q_rng, shape[:1] + (1,) + shape[2:], dtype)
      kv = init_kv(kv_rng, shape[:1] + (2,) + shape[2:], dtype)
      return jnp.concatenate([q, kv], axis=1)
    qkv_BL3NH = Dense(cfg, "bld,dtnh->bltnh", (d, 3, n, h), ("embed", "qkv", "heads", "kv"),
                      None, init=init_qkv, name="qkv")(x_BLD)
    q_BLNH, k_BSNH, v_BSNH = (qkv_BL3NH[:, :, i] for i in range(3))
    q_BLNH = layers.constrain(q_BLNH, layers.ACT_BLNH)
    if self.decode:
      k_BSNH, v_BSNH, mask = attention.kv_cache(self, k_BSNH, v_BSNH, mask)
    # T5 folds 1/sqrt(H) into the query's initialisation: the scores are not divided.
    out_BLNH = attention.attend(cfg, q_BLNH, k_BSNH, v_BSNH, mask,
                                deterministic=self.deterministic, decode=self.decode,
                                score_bias_BNLS=bias_1NLS, score_divisor=1.0)
    out_BLNH = layers.constrain(out_BLNH, layers.ACT_BLNH)
    return Dense(cfg, "blnh,nhd->bld", (n, h, d), ("heads", "kv", "embed"), None,
                 init=_init(cfg, n * h), name="out")(out_BLNH)


class Block(nn.Module):
  """One pre-LN layer: self-attention, (in the decoder) cross-attention, MLP; each sub-block
  x + dropout(f(norm(x))). Returns `(x, None)` to run unrolled or under nn.scan."""

  config: ModelConfig
  decoder: bool = False
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x_BLD: Array, mask: attention.AttentionMask, bias_1NLS: Array,
               encoded_BSD: Array | None, cross: attention.AttentionMask | None
               ) -> tuple[Array, None]:
    cfg = self.config
    dropout = functools.partial(Dropout(cfg.hidden_dropout, cfg.dropout_rng),
                                deterministic=self.deterministic)
    h_BLD = rms_norm(cfg, "attention_norm")(x_BLD)
    x_BLD = x_BLD + dropout(SelfAttention(cfg, self.deterministic, self.decode,
                                          name="attention")(h_BLD, mask, bias_1NLS))
    d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    if self.decoder:
      h_BLD = rms_norm(cfg, "cross_attention_norm")(x_BLD)
      x_BLD = x_BLD + dropout(encoder_decoder.CrossAttention(
          cfg, _query_init(cfg), _init(cfg, d), _init(cfg, n * h), score_divisor=1.0,
          deterministic=self.deterministic, decode=self.decode,
          name="cross_attention")(h_BLD, encoded_BSD, cross))
    h_BLD = rms_norm(cfg, "mlp_norm")(x_BLD)
    mlp = layers.Mlp(cfg, self.deterministic, cfg.activation_dropout, _init(cfg, d),
                     _init(cfg, cfg.mlp_dim), name="mlp")
    x_BLD = x_BLD + dropout(mlp(h_BLD))
    return layers.constrain(x_BLD, layers.ACT_BLD), None


class Stack(nn.Module):
  """The encoder's or the decoder's layers between the embedded tokens and the final norm (and
  dropout), with the relative bias its layers share."""

  config: ModelConfig
  decoder: bool = False

  @nn.compact
  def __call__(self, x_BLD: Array, mask: attention.AttentionMask, deterministic: bool,
               encoded_BSD: Array | None = None,
               cross: attention.AttentionMask | None = None, decode: bool = False) -> Array:
    """`decode=True` (the decoder in generation): the queries are the L tokens after the
    cache's `index` already decoded, the keys all the cache's slots (as many as the first,
    creating call's tokens)."""
    cfg = self.config
    dropout = Dropout(cfg.hidden_dropout, cfg.dropout_rng)
    x_BLD = layers.constrain(dropout(x_BLD, deterministic=deterministic), layers.ACT_BLD)
    length = keys = x_BLD.shape[1]
    offset = 0
    if decode:
      initialized = self.has_variable("cache", "index")
      slots = self.variable("cache", "slots", jnp.zeros, (length,), jnp.int32)
      index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
      keys, offset = slots.value.shape[0], index.value
      if initialized:
        index.value = offset + length
    bias_1NLS = RelativeBias(cfg, bidirectional=not self.decoder, name="relative_bias")(
        length, keys, offset)
    x_BLD = encoder_decoder.run_layers(Block, cfg, self.decoder, deterministic, decode, x_BLD,
                                       mask, bias_1NLS, encoded_BSD, cross)
    x_BLD = rms_norm(cfg, "final_norm")(x_BLD)
    return layers.constrain(dropout(x_BLD, deterministic=deterministic), layers.ACT_BLD)


class T5(encoder_decoder.EncoderDecoder):
  """The encoder-decoder with its LM head (transformers' T5ForConditionalGeneration).

  Inputs: the encoder's tokens [B, S] and the decoder's [B, L] (the targets shifted right behind
  the start token, id 0, as transformers' `_shift_right`); masks 1 = token, 0 = padding; with
  packing, `encoder_segments` and `decoder_segments` number the examples in each row (0 =
  padding; decoder position reads only the encoder positions of its own example).
  """

  def setup(self) -> None:
    cfg = self.config
    self.shared = layers.embed(cfg, cfg.vocab_size, ("vocab", "embed"), "shared",
                               layers.ACT_BLD)
    self.encoder = Stack(cfg, decoder=False)
    self.decoder = Stack(cfg, decoder=True)

  def encode(self, input_ids_BS: Array, attention_mask_BS: Array | None = None,
             encoder_segments_BS: Array | None = None, deterministic: bool = True) -> Array:
    """The encoder's final hidden states [B, S, D] (transformers' T5EncoderModel)."""
    mask = encoder_decoder.encoder_mask(input_ids_BS, attention_mask_BS, encoder_segments_BS)
    return self.encoder(self.shared(input_ids_BS), mask, deterministic)

  def decode(self, decoder_input_ids_BL: Array, encoded_BSD: Array | None,
             attention_mask_BS: Array | None = None, decoder_attention_mask_BL: Array | None = None,
             encoder_segments_BS: Array | None = None, decoder_segments_BL: Array | None = None,
             deterministic: bool = True, decode: bool = False) -> Array:
    """Next-token logits [B, L, V] in float32 given the encoder's output. `decode=True`
    (generation, bertjax/inference/seq2seq.py; apply with `mutable=["cache"]`): the L tokens
    after those already in the decoder's KV cache; the cross-attention keys and values are
    computed when `encoded_BSD` is given and cached for the calls without it, whose
    `attention_mask_BS` is the encoder's padding."""
    cfg = self.config
    length = decoder_input_ids_BL.shape[1]
    self_mask, cross = encoder_decoder.decoder_masks(
        length, encoded_BSD, attention_mask_BS, decoder_attention_mask_BL, encoder_segments_BS,
        decoder_segments_BL, decode)
    x_BLD = self.decoder(self.shared(decoder_input_ids_BL), self_mask, deterministic,
                         encoded_BSD, cross, decode)
    if cfg.scale_decoder_outputs:
      x_BLD = x_BLD * cfg.hidden_size ** -0.5
    return self.lm_logits(self.shared, x_BLD)
    return self.decode(decoder_input_ids_BL, encoded_BSD, attention_mask_BS,
                       decoder_attention_mask_BL, encoder_segments_BS, decoder_segments_BL,
                       deterministic)


def check(config: ModelConfig) -> None:
  """T5's relative buckets: half each way, exact below half of them."""
  if not 0 < config.relative_attention_buckets // 2 < config.relative_attention_max_distance:
    raise ValueError(f"model.relative_attention_buckets ({config.relative_attention_buckets}) "
                     f"must be >= 2 and below twice model.relative_attention_max_distance "
                     f"({config.relative_attention_max_distance})")


FAMILY = Family(
    name="t5", kind="encoder_decoder", build=lambda config, head: T5(config),
    layer_stacks=encoder_decoder.layer_stacks, objectives=("span_corruption",),
    lm_objective="span_corruption",
    options=frozenset({"head_size", "decoder_layers", "mlp_gated", "relative_attention_buckets",
                       "relative_attention_max_distance", "scale_decoder_outputs",
                       "activation_dropout"}),
    check=check, score_bias=True, unbounded_positions=True, tokenizer_style="t5",
    sample_prompt="The city lies on the <extra_id_0> of the river.")
