"""SpanBERT (Joshi et al. 2020): BERT's pre-training heads plus the span-boundary objective's
head (SBO, §3.2), which predicts each token of a masked span from the encoder's outputs at the
two tokens just outside the span and a learned embedding of the token's offset in it.

The model is `BertForPreTraining` itself (its code and parameter tree; the unused NSP head is
kept so that BERT checkpoints load and the weights export as BERT) plus `sbo`, whose output
goes through the MLM head's tied decoder and bias (facebookresearch/SpanBERT's head adds a bias
of its own).

The guide: docs/models.md, 'SpanBERT's span-boundary head'.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import activations, layers, precision
from bertjax.models.bert import BertForPreTraining, gather_positions
from bertjax.models.config import ModelConfig

Array = jax.Array

# SpanBERT's longest span (10 words, Joshi et al. 2020 §3.1): the SBO head's position rows.
MAX_SPAN_LENGTH = 10


class SpanBertOutput(NamedTuple):
  mlm_logits: Array  # [B, P, V] at the gathered positions ([B, L, V] without positions)
  nsp_logits: Array  # [B, 2]
  sbo_logits: Array  # [B, P, V]: each masked position predicted from its span's boundary
  pooled: Array  # [B, D]
  sequence: Array  # [B, L, D]


class SpanBoundaryHead(nn.Module):
  """y_i = f(x_{s-1}, x_{e+1}, p_{i-s+1}) (Joshi et al. 2020, §3.2): the encoder's outputs at
  the two boundary tokens and the offset's row p of a learned table [max_span_length, D]; f is
  two layers of Dense, activation (the model's, GeLU in SpanBERT) and LayerNorm on
  h0 = [x_{s-1}; x_{e+1}; p]. Returns y [B, P, D], which the caller decodes to the vocabulary.

  Offsets are 1-based; 0 (a slot without an SBO target) reads row 0, and the loss gives such
  slots no weight."""

  config: ModelConfig
  max_span_length: int = MAX_SPAN_LENGTH

  @nn.compact
  def __call__(self, sequence_BLD: Array, left_BP: Array, right_BP: Array,
               offsets_BP: Array) -> Array:
    cfg = self.config
    d = cfg.hidden_size
    left_BPD = gather_positions(sequence_BLD, left_BP)
    right_BPD = gather_positions(sequence_BLD, right_BP)
    table = layers.embed(cfg, self.max_span_length, (None, "embed"), "position_embeddings")
    offset_BPD = table(jnp.clip(offsets_BP - 1, 0, self.max_span_length - 1))
    h_BPK = jnp.concatenate([left_BPD, right_BPD, offset_BPD.astype(left_BPD.dtype)], axis=-1)
    act = activations.activation_fn(cfg.activation)
    h_BPD = layers.Dense(cfg, "bpk,kd->bpd", (3 * d, d), ("embed", "mlp"), (d,), ("mlp",),
                         name="dense1")(layers.constrain(h_BPK, layers.ACT_BLD))
    # The layout between the two layers pinned: left free, XLA (jax 0.10, Shardy) partitions
    # the head on a (2, 2, 2) data/fsdp/tensor mesh so that its backward pass is wrong (every
    # gradient off by ~1%, the loss right), as layers.tied_logits describes for the decoder.
    h_BPD = layers.constrain(layers.layer_norm(cfg, "norm1")(act(h_BPD)), layers.ACT_BLD)
    h_BPD = layers.Dense(cfg, "bpd,de->bpe", (d, d), ("embed", "mlp"), (d,), ("mlp",),
                         name="dense2")(h_BPD)
    return layers.constrain(layers.layer_norm(cfg, "norm2")(act(h_BPD)), layers.ACT_BLD)


class SpanBertForPreTraining(BertForPreTraining):
  """`BertForPreTraining` (its MLM head with sparse prediction at `masked_positions`, its NSP
  head: the same code and parameters) plus `SpanBoundaryHead` under `sbo`, whose output the
  MLM head's decoder turns into logits: the word embeddings (tied) and `mlm_bias`.

  The span inputs (`span_*_BP`, aligned with `masked_positions_BP`) are the batch's
  `span_left_positions`, `span_right_positions` and `span_offsets`; without them (parameter
  initialisation) the SBO head runs on one dummy slot per row so that its parameters exist.
  """

  max_span_length: int = MAX_SPAN_LENGTH

  @nn.compact
  def __call__(self, input_ids_BL: Array, token_type_ids_BL: Array | None = None,
               attention_mask_BL: Array | None = None, masked_positions_BP: Array | None = None,
               deterministic: bool = True, document_ids_BL: Array | None = None,
               positions_BL: Array | None = None, span_left_positions_BP: Array | None = None,
               span_right_positions_BP: Array | None = None,
               span_offsets_BP: Array | None = None) -> SpanBertOutput:
    cfg = self.config
    if cfg.embedding_width != cfg.hidden_size:
      raise ValueError(f"SpanBERT's SBO head decodes {cfg.hidden_size}-wide vectors through the "
                       f"word embeddings, which are {cfg.embedding_width} wide: set "
                       "model.embedding_size to 0 (the hidden size)")
    out = super().__call__(input_ids_BL, token_type_ids_BL, attention_mask_BL,
                           masked_positions_BP, deterministic, document_ids_BL, positions_BL)
    if span_offsets_BP is None:
      dummy = jnp.zeros((input_ids_BL.shape[0], 1), jnp.int32)
      span_left_positions_BP, span_right_positions_BP, span_offsets_BP = dummy, dummy, dummy + 1
    y_BPD = SpanBoundaryHead(cfg, self.max_span_length, name="sbo")(
        out.sequence, span_left_positions_BP, span_right_positions_BP, span_offsets_BP)
    # The MLM decoder, read from the parameters BertForPreTraining's head created: its
    # submodules are not reachable from here. As Embed.attend through layers.tied_logits (the
    # input's layout pinned first; see there why).
    params = self.variables["params"]
    table_VD = nn.meta.unbox(params["bert"]["word_embeddings"]["embedding"])
    bias_V = nn.meta.unbox(params["mlm_bias"])
    y_BPD = layers.constrain(y_BPD, layers.ACT_BLD)
    logits_BPV = precision.einsum(cfg, "bpd,vd->bpv", y_BPD, table_VD)
    logits_BPV = logits_BPV + bias_V.astype(logits_BPV.dtype)[None, None, :]
    logits_BPV = layers.constrain(logits_BPV, ("batch", "length", "vocab"))
    return SpanBertOutput(out.mlm_logits, out.nsp_logits, logits_BPV.astype(jnp.float32),
                          out.pooled, out.sequence)
