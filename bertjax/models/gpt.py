"""GPT decoders: GPT-1 (Radford et al. 2018, post-LN) and GPT-2/3 (Radford et al. 2019, pre-LN
with a final LayerNorm), learned positions, causal attention and an LM head tied to the token
embedding.

Numerically identical to Hugging Face `GPT2LMHeadModel` / `OpenAIGPTLMHeadModel` given the
same weights (tests/test_parity_hf.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import attention, layers
from bertjax.models.config import ModelConfig
from bertjax.models.dropout import Dropout
from bertjax.models.families import Family, LayerStacks

Array = jax.Array


class GPT(nn.Module):
  """Token + learned position embeddings, causal layer stack, tied LM head."""

  config: ModelConfig

  def setup(self) -> None:
    cfg = self.config
    self.wte = layers.embed(cfg, cfg.vocab_size, ("vocab", "embed"), "wte", layers.ACT_BLD)
    self.wpe = layers.embed(cfg, cfg.max_positions, (None, "embed"), "wpe")
    self.dropout = Dropout(cfg.hidden_dropout, cfg.dropout_rng)
    self.decoder = layers.LayerStack(cfg)
    if cfg.norm_position == "pre" and cfg.final_layer_norm:
      self.final_norm = layers.layer_norm(cfg, "final_norm")

  def __call__(self, input_ids_BL: Array, positions_BL: Array | None = None,
               document_ids_BL: Array | None = None, attention_mask_BL: Array | None = None,
               deterministic: bool = True, decode: bool = False) -> Array:
    """Returns next-token logits [B, L, V] in fp32.

    `positions` restart at 0 in each packed document (default 0..L-1).

    `decode=True` (generation, bertjax/inference/generate.py): the input is the next L tokens of
    each row, written to the KV cache (collection "cache", apply with `mutable=["cache"]`) at its
    current index; `positions_BL` is required (each row's own positions) and
    `attention_mask_BL` is over the cache's S slots (1 = a real token, 0 = padding); attention
    is causal by cache slot.
    """
    cfg = self.config
    _, length = input_ids_BL.shape
    if decode:
      if positions_BL is None:
        raise ValueError("decode=True needs positions_BL (each row's token positions)")
      if document_ids_BL is not None:
        raise ValueError("decode=True does not take document_ids_BL")
      mask = attention.AttentionMask(
          jnp.ones((1, 1, 1, 1), bool) if attention_mask_BL is None
          else attention_mask_BL.astype(bool)[:, None, None, :])
    else:
      mask = attention.decoder_mask(length, document_ids_BL, attention_mask_BL)
    x_BLD = self._hidden(input_ids_BL, positions_BL, mask, deterministic, decode)
    logits_BLV = layers.tied_logits(cfg, self.wte, x_BLD)
    return layers.constrain(logits_BLV, ("batch", "length", "vocab")).astype(jnp.float32)

  def features(self, input_ids_BL: Array, positions_BL: Array | None = None,
               document_ids_BL: Array | None = None,
               deterministic: bool = True) -> tuple[Array, Array]:
    """(final hidden states [B, L, D], the tied token table [V, D]): what the LM head
    multiplies, for a loss that projects onto the vocabulary itself in chunks
    (`model.loss_chunk`, bertjax/training/objectives.py)."""
    mask = attention.decoder_mask(input_ids_BL.shape[1], document_ids_BL)
    x_BLD = self._hidden(input_ids_BL, positions_BL, mask, deterministic)
    return layers.constrain(x_BLD, layers.ACT_BLD), self.wte.embedding

  def _hidden(self, input_ids_BL: Array, positions_BL: Array | None,
              mask: attention.AttentionMask, deterministic: bool,
              decode: bool = False) -> Array:
    """Embeddings, the layer stack and the final LayerNorm: the hidden states the LM head
    reads."""
    cfg = self.config
    if positions_BL is None:
      positions_BL = jnp.arange(input_ids_BL.shape[1])[None, :]
    x_BLD = self.wte(input_ids_BL) + self.wpe(positions_BL)
    x_BLD = layers.constrain(self.dropout(x_BLD, deterministic=deterministic), layers.ACT_BLD)
    x_BLD = self.decoder(x_BLD, mask, deterministic, decode)
    if cfg.norm_position == "pre" and cfg.final_layer_norm:
      x_BLD = self.final_norm(x_BLD)
    return x_BLD


def layer_stacks(config: ModelConfig) -> LayerStacks:
  return [(("decoder",), config.num_layers)]


_FUSED_QKV = " (GPT-2's fused c_attn is one target: qkv)"
FAMILY = Family(
    name="gpt", kind="decoder", build=lambda config, head: GPT(config),
    layer_stacks=layer_stacks, objectives=("causal_lm",), lm_objective="causal_lm",
    options=frozenset({"loss_chunk", "lora_rank", "adapter_size", "prefix_length"}),
    lora_targets=("qkv", "out", "wi", "wo"), default_lora_targets=("qkv",),
    lora_hints={"query": _FUSED_QKV, "key": _FUSED_QKV, "value": _FUSED_QKV},
    tokenizer_style="gpt")
