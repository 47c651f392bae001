"""BART (Lewis et al. 2020, "BART: Denoising Sequence-to-Sequence Pre-training for Natural
Language Generation, Translation, and Comprehension"): a bidirectional encoder and a causal
decoder with cross-attention, each with learned positions (a table of max_positions + 2 rows,
read at position + 2 as fairseq's), a LayerNorm on the embeddings, post-LN layers with biases and
GeLU, one token table for both inputs and the LM head.

Numerically identical to `transformers`' BartForConditionalGeneration given the same weights
(tests/test_bart.py), padding and packed examples included: with segment ids, positions restart
in every example, as each example alone. transformers' `final_logits_bias` is a buffer of zeros
that nothing trains; it is not a parameter here (bertjax/hf/bart.py writes and checks it).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import attention, encoder_decoder, layers
from bertjax.models.config import ModelConfig
from bertjax.models.dropout import Dropout
from bertjax.models.families import Family

Array = jax.Array
# fairseq's learned positions start at padding_idx + 1 = 2.
POSITION_OFFSET = 2


def segment_positions(segments_BL: Array) -> Array:
  """Each position's index within its packed example (examples are contiguous runs of one
  segment id)."""
  index_BL = jnp.broadcast_to(jnp.arange(segments_BL.shape[1]), segments_BL.shape)
  starts_BL = jnp.concatenate([jnp.ones_like(segments_BL[:, :1], bool),
                               segments_BL[:, 1:] != segments_BL[:, :-1]], axis=1)
  return index_BL - jax.lax.cummax(jnp.where(starts_BL, index_BL, 0), axis=1)


class Block(nn.Module):
  """One post-LN layer: self-attention, (in the decoder) cross-attention, MLP; each sub-block
  norm(x + dropout(f(x))). Returns `(x, None)` to run unrolled or under nn.scan."""

  config: ModelConfig
  decoder: bool = False
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x_BLD: Array, mask: attention.AttentionMask, encoded_BSD: Array | None,
               cross: attention.AttentionMask | None) -> tuple[Array, None]:
    cfg = self.config
    dropout = functools.partial(Dropout(cfg.hidden_dropout, cfg.dropout_rng),
                                deterministic=self.deterministic)
    init = layers.kernel_init(cfg)
    self_attention = layers.SelfAttention(cfg, self.deterministic, self.decode, name="attention")
    x_BLD = layers.layer_norm(cfg, "attention_norm")(x_BLD + dropout(self_attention(x_BLD, mask)))
    if self.decoder:
      cross_attention = encoder_decoder.CrossAttention(cfg, init, init, init,
                                                       deterministic=self.deterministic,
                                                       decode=self.decode,
                                                       name="cross_attention")
      x_BLD = layers.layer_norm(cfg, "cross_attention_norm")(
          x_BLD + dropout(cross_attention(x_BLD, encoded_BSD, cross)))
    mlp = layers.Mlp(cfg, self.deterministic, cfg.activation_dropout, init, init, name="mlp")
    x_BLD = layers.layer_norm(cfg, "mlp_norm")(x_BLD + dropout(mlp(x_BLD)))
    return layers.constrain(x_BLD, layers.ACT_BLD), None


class Stack(nn.Module):
  """The encoder's or the decoder's positions, embedding norm and layers, from the embedded
  tokens."""

  config: ModelConfig
  decoder: bool = False

  @nn.compact
  def __call__(self, tokens_BLD: Array, positions_BL: Array, mask: attention.AttentionMask,
               deterministic: bool, encoded_BSD: Array | None = None,
               cross: attention.AttentionMask | None = None, decode: bool = False) -> Array:
    """`decode=True` (the decoder in generation): the L tokens after the cache's `index`
    already decoded, at those positions."""
    cfg = self.config
    if decode:
      initialized = self.has_variable("cache", "index")
      index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
      positions_BL = positions_BL + index.value
      if initialized:
        index.value = index.value + tokens_BLD.shape[1]
    table = layers.embed(cfg, cfg.max_positions + POSITION_OFFSET, (None, "embed"), "positions")
    x_BLD = tokens_BLD + table(positions_BL + POSITION_OFFSET)
    x_BLD = layers.layer_norm(cfg, "embedding_norm")(x_BLD)
    x_BLD = Dropout(cfg.hidden_dropout, cfg.dropout_rng)(x_BLD, deterministic=deterministic)
    x_BLD = layers.constrain(x_BLD, layers.ACT_BLD)
    return encoder_decoder.run_layers(Block, cfg, self.decoder, deterministic, decode, x_BLD,
                                      mask, encoded_BSD, cross)


class Bart(encoder_decoder.EncoderDecoder):
  """The encoder-decoder with its tied LM head (transformers' BartForConditionalGeneration).

  Inputs as T5's (bertjax/models/t5.py): the encoder's tokens [B, S], the decoder's [B, L]
  (the targets shifted right behind the decoder start token, BART's </s>), masks 1 = token, and
  with packing the examples' segment ids.
  """

  def setup(self) -> None:
    cfg = self.config
    self.shared = layers.embed(cfg, cfg.vocab_size, ("vocab", "embed"), "shared",
                               layers.ACT_BLD)
    self.encoder = Stack(cfg, decoder=False)
    self.decoder = Stack(cfg, decoder=True)

  def _tokens(self, ids_BL: Array) -> Array:
    cfg = self.config
    x_BLD = self.shared(ids_BL)
    return x_BLD * cfg.hidden_size ** 0.5 if cfg.scale_embeddings else x_BLD

  def encode(self, input_ids_BS: Array, attention_mask_BS: Array | None = None,
             encoder_segments_BS: Array | None = None, deterministic: bool = True) -> Array:
    """The encoder's final hidden states [B, S, D] (transformers' encoder_last_hidden_state)."""
    mask = encoder_decoder.encoder_mask(input_ids_BS, attention_mask_BS, encoder_segments_BS)
    return self.encoder(self._tokens(input_ids_BS), _positions(input_ids_BS, encoder_segments_BS),
                        mask, deterministic)

  def decode(self, decoder_input_ids_BL: Array, encoded_BSD: Array | None,
             attention_mask_BS: Array | None = None, decoder_attention_mask_BL: Array | None = None,
             encoder_segments_BS: Array | None = None, decoder_segments_BL: Array | None = None,
             deterministic: bool = True, decode: bool = False) -> Array:
    """Next-token logits [B, L, V] in float32 given the encoder's output; `decode=True` as
    T5's (bertjax/models/t5.py)."""
    self_mask, cross = encoder_decoder.decoder_masks(
        decoder_input_ids_BL.shape[1], encoded_BSD, attention_mask_BS, decoder_attention_mask_BL,
        encoder_segments_BS, decoder_segments_BL, decode)
    x_BLD = self.decoder(self._tokens(decoder_input_ids_BL),
                         _positions(decoder_input_ids_BL, decoder_segments_BL), self_mask,
                         deterministic, encoded_BSD, cross, decode)
    return self.lm_logits(self.shared, x_BLD)
    return self.decode(decoder_input_ids_BL, encoded_BSD, attention_mask_BS,
                       decoder_attention_mask_BL, encoder_segments_BS, decoder_segments_BL,
                       deterministic)


def _positions(ids_BL: Array, segments_BL: Array | None) -> Array:
  if segments_BL is None:
    return jnp.broadcast_to(jnp.arange(ids_BL.shape[1]), ids_BL.shape)
  return segment_positions(segments_BL)


FAMILY = Family(
    name="bart", kind="encoder_decoder", build=lambda config, head: Bart(config),
    layer_stacks=encoder_decoder.layer_stacks, objectives=("denoising",),
    lm_objective="denoising",
    options=frozenset({"head_size", "decoder_layers", "activation_dropout",
                       "scale_embeddings"}),
    tokenizer_style="bart", sample_prompt="The city lies on the <mask> of the river.")
