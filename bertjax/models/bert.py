"""BERT (Devlin et al. 2019): encoder, pooler, MLM/NSP pre-training heads, fine-tuning heads
(sequence and token classification, extractive question answering).

Numerically identical to Hugging Face `BertForPreTraining` given the same weights (tests/
test_parity_hf.py); the name mapping lives in bertjax/hf/.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import activations, attention, layers, sharing
from bertjax.models.config import ModelConfig
from bertjax.models.dropout import Dropout

Array = jax.Array


class BertModel(nn.Module):
  """Embeddings + encoder + pooler. `attend` is the tied output projection of the MLM head.

  The embedding layout follows `config.architecture`: BERT's tables summed and normalised;
  ELECTRA's at `embedding_size`, normalised, then projected to the hidden size (ALBERT's
  alike, projected whatever the widths); DeBERTa's projected (no bias), normalised and zeroed
  at padding. A generator that shares its
  discriminator's embeddings (ELECTRA) is built with `shared_embeddings=False` and is called
  with `embedded_BLE`, the discriminator's `embeddings(...)` of its input; DeBERTa-v3's
  discriminator is built with `base_word_embeddings`, the generator's word table.
  """

  config: ModelConfig
  # Whether this model holds its own embedding tables (False: an ELECTRA generator's, which
  # reads its discriminator's).
  shared_embeddings: bool = True
  # The table under the word embeddings' residual (gradient-disentangled sharing), or None.
  base_word_embeddings: layers.Embed | None = None

  def setup(self) -> None:
    cfg = self.config
    width = cfg.embedding_width
    if self.shared_embeddings:
      self.word_embeddings = layers.embed(cfg, cfg.vocab_size, ("vocab", "embed"),
                                          "word_embeddings", layers.ACT_BLD, width,
                                          self.base_word_embeddings)
      if cfg.position_embedding == "learned":
        self.position_embeddings = layers.embed(cfg, cfg.max_positions, (None, "embed"),
                                                "position_embeddings", width=width)
      if cfg.type_vocab_size:
        self.token_type_embeddings = layers.embed(cfg, cfg.type_vocab_size, (None, "embed"),
                                                  "token_type_embeddings", width=width)
      self.embeddings_norm = layers.layer_norm(cfg, "embeddings_norm")
    if cfg.projects_embeddings:
      # ELECTRA's and ALBERT's projection has a bias, DeBERTa's none.
      self.embeddings_project = layers.Dense(
          cfg, "ble,ed->bld", (width, cfg.hidden_size), (None, "embed"),
          (cfg.hidden_size,) if cfg.architecture != "deberta" else None, ("embed",))
    self.encoder = sharing.layer_stack(cfg)
    self.dropout = Dropout(cfg.hidden_dropout, cfg.dropout_rng)
    if cfg.norm_position == "pre" and cfg.final_layer_norm:
      self.final_norm = layers.layer_norm(cfg, "final_norm")
    if cfg.pooler:
      self.pooler = layers.Dense(cfg, "bd,de->be", (cfg.hidden_size, cfg.hidden_size),
                                 ("embed", "mlp"), (cfg.hidden_size,), ("mlp",))

  def embeddings(self, input_ids_BL: Array, token_type_ids_BL: Array | None = None,
                 attention_mask_BL: Array | None = None, deterministic: bool = True,
                 positions_BL: Array | None = None) -> Array:
    """The embedding output the encoder reads; for ELECTRA and ALBERT before the projection to
    the hidden size ([B, L, embedding_size]: what a sharing generator reads too)."""
    cfg = self.config
    _, length = input_ids_BL.shape
    x_BLE = self.word_embeddings(input_ids_BL)
    if cfg.position_embedding == "learned":
      x_BLE = x_BLE + self.position_embeddings(
          jnp.arange(length)[None, :] if positions_BL is None else positions_BL)
    if cfg.type_vocab_size:
      x_BLE = x_BLE + self.token_type_embeddings(
          jnp.zeros_like(input_ids_BL) if token_type_ids_BL is None else token_type_ids_BL)
    if cfg.architecture == "deberta":
      if cfg.projects_embeddings:
        x_BLE = self.embeddings_project(x_BLE)
      x_BLE = self.embeddings_norm(x_BLE)
      if attention_mask_BL is not None:
        x_BLE = x_BLE * attention_mask_BL[..., None].astype(x_BLE.dtype)
    else:
      x_BLE = self.embeddings_norm(x_BLE)
    return self.dropout(x_BLE, deterministic=deterministic)

  def __call__(self, input_ids_BL: Array, token_type_ids_BL: Array | None = None,
               attention_mask_BL: Array | None = None, deterministic: bool = True,
               document_ids_BL: Array | None = None, positions_BL: Array | None = None,
               embedded_BLE: Array | None = None) -> tuple[Array, Array]:
    """Returns (sequence_output [B, L, D], pooled_output [B, D]).

    Packed rows (several documents per row, no padding between them) pass `document_ids`
    (1, 2, ... per document, 0 on padding: no attention across documents) and `positions`
    (restarting at 0 in each document); by default one document per row at 0, 1, ...
    `embedded_BLE`: the embedding output, computed elsewhere (a sharing generator's).
    """
    cfg = self.config
    if attention_mask_BL is None:
      attention_mask_BL = jnp.ones_like(input_ids_BL)
    x = embedded_BLE
    if x is None:
      x = self.embeddings(input_ids_BL, token_type_ids_BL, attention_mask_BL, deterministic,
                          positions_BL)
    if cfg.architecture != "deberta" and cfg.projects_embeddings:
      x = self.embeddings_project(x)
    x_BLD = layers.constrain(x, layers.ACT_BLD)
    # Padding masked on keys only; outputs at padded query positions are unused.
    mask = attention.encoder_mask(attention_mask_BL, document_ids_BL)
    x_BLD = self.encoder(x_BLD, mask, deterministic, positions_BL=positions_BL)
    if cfg.norm_position == "pre" and cfg.final_layer_norm:
      x_BLD = self.final_norm(x_BLD)
    pooled_BD = jnp.tanh(self.pooler(x_BLD[:, 0])) if cfg.pooler else x_BLD[:, 0]
    return x_BLD, pooled_BD

  def attend(self, x: Array) -> Array:
    """x @ word_embeddings.T: the MLM decoder tied to the input embedding."""
    return layers.tied_logits(self.config, self.word_embeddings, x)


class PretrainingOutput(NamedTuple):
  # [B, P, V] at the gathered positions, or [B, L, V] when no positions were given.
  mlm_logits: Array
  nsp_logits: Array  # [B, 2]; class 0 = IsNext, 1 = random (google-research/bert #125)
  pooled: Array  # [B, D]
  sequence: Array  # [B, L, D]


def gather_positions(x_BLD: Array, positions_BP: Array) -> Array:
  """google-research/bert's `gather_indexes`: rows of x at `masked_lm_positions`."""
  return jnp.take_along_axis(x_BLD, positions_BP[:, :, None], axis=1)


class BertForPreTraining(nn.Module):
  """BERT with the MLM head (dense+act+LayerNorm, tied decoder, own bias) and the NSP head
  (ALBERT's sentence-order head is the same, on the pooled output; ALBERT's and an ELECTRA
  generator's MLM transform narrows to the embedding width).

  With `masked_positions` the vocabulary projection runs only at those positions (sparse
  prediction, as google-research/bert); without, at every position.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, input_ids_BL: Array, token_type_ids_BL: Array | None = None,
               attention_mask_BL: Array | None = None, masked_positions_BP: Array | None = None,
               deterministic: bool = True, document_ids_BL: Array | None = None,
               positions_BL: Array | None = None) -> PretrainingOutput:
    cfg = self.config
    d = cfg.hidden_size
    bert = BertModel(cfg, name="bert")
    sequence_BLD, pooled_BD = bert(input_ids_BL, token_type_ids_BL, attention_mask_BL,
                                   deterministic, document_ids_BL, positions_BL)
    h = sequence_BLD
    if masked_positions_BP is not None:
      h = gather_positions(sequence_BLD, masked_positions_BP)
    if cfg.architecture == "electra":  # an ELECTRA generator (ElectraForMaskedLM)
      h = generator_transform(cfg, h, "mlm_transform", "mlm_norm")
    elif cfg.architecture == "albert":  # transformers' AlbertMLMHead: the model's activation
      h = generator_transform(cfg, h, "mlm_transform", "mlm_norm", cfg.activation)
    else:
      h = transform(cfg, h, "mlm_transform", "mlm_norm")
    bias_V = self.param("mlm_bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                 ("vocab",)),
                        (cfg.vocab_size,), cfg.weight_dtype)
    mlm_logits = bert.attend(h)
    mlm_logits = mlm_logits + bias_V.astype(mlm_logits.dtype)[None, None, :]
    mlm_logits = layers.constrain(mlm_logits, ("batch", "length", "vocab"))
    nsp_logits_B2 = layers.Dense(cfg, "bd,dc->bc", (d, 2), ("embed", None), (2,), (None,),
                                 name="nsp")(pooled_BD)
    return PretrainingOutput(mlm_logits.astype(jnp.float32), nsp_logits_B2.astype(jnp.float32),
                             pooled_BD, sequence_BLD)


def transform(cfg: ModelConfig, x: Array, dense_name: str, norm_name: str) -> Array:
  """Dense (width to width) + activation + LayerNorm over the last axis: the MLM head's
  transform and a no-pooler model's prediction head (inside a compact module, whose
  submodules it creates under the two names)."""
  d = cfg.hidden_size
  rows = "abc"[:x.ndim - 1]
  x = layers.Dense(cfg, f"{rows}d,de->{rows}e", (d, d), ("embed", "mlp"),
                   (d,) if cfg.head_bias else None, ("mlp",), name=dense_name)(x)
  return layers.layer_norm(cfg, norm_name)(activations.activation_fn(cfg.activation)(x))


def generator_transform(cfg: ModelConfig, x: Array, dense_name: str, norm_name: str,
                        activation: str = "gelu") -> Array:
  """ELECTRA's generator head: dense to the embedding width, GELU (the exact form whatever the
  model's activation, as transformers' ElectraGeneratorPredictions), LayerNorm; ALBERT's MLM
  head passes its model's `activation`. Inside a compact module, whose submodules it creates
  under the two names."""
  rows = "abc"[:x.ndim - 1]
  e = cfg.embedding_width
  x = layers.Dense(cfg, f"{rows}d,de->{rows}e", (cfg.hidden_size, e), ("embed", None), (e,),
                   (None,), name=dense_name)(x)
  return layers.layer_norm(cfg, norm_name)(activations.activation_fn(activation)(x))


def prediction_head(cfg: ModelConfig, x: Array, name: str = "head") -> Array:
  """A model without BERT's pooler (ModernBERT) puts dense + activation + LayerNorm before a
  fine-tuning classifier, as Hugging Face's ModernBertPredictionHead; ELECTRA and DeBERTa put
  theirs before the sequence classifier only (`classification_head`); ALBERT has the pooler."""
  if cfg.pooler or cfg.architecture != "bert":
    return x
  return transform(cfg, x, f"{name}_dense", f"{name}_norm")


def classification_head(cfg: ModelConfig, cls_BD: Array, deterministic: bool) -> Array:
  """What the sequence classifier reads: BERT's and ALBERT's pooled output (`prediction_head`
  without a pooler), or for ELECTRA and DeBERTa [CLS]'s state through dropout, dense and GELU
  (transformers' ElectraClassificationHead, DeBERTa's ContextPooler); the dropout before the
  classifier is the caller's."""
  if cfg.architecture in ("bert", "albert"):
    return prediction_head(cfg, cls_BD)
  cls_BD = Dropout(cfg.hidden_dropout, cfg.dropout_rng)(cls_BD, deterministic=deterministic)
  d = cfg.hidden_size
  cls_BD = layers.Dense(cfg, "bd,de->be", (d, d), ("embed", "mlp"), (d,), ("mlp",),
                        name="head_dense")(cls_BD)
  return activations.activation_fn("gelu")(cls_BD)


def per_token_logits(cfg: ModelConfig, sequence_BLD: Array, num: int, name: str) -> Array:
  """A linear head on every token's output: [B, L, num] in fp32 (called inside a compact
  module, whose parameter `name` it creates)."""
  logits_BLC = layers.Dense(cfg, "bld,dc->blc", (cfg.hidden_size, num), ("embed", None),
                            (num,), (None,), name=name)(sequence_BLD)
  return logits_BLC.astype(jnp.float32)


class BertForSequenceClassification(nn.Module):
  """BERT with dropout and a linear classifier on the pooled [CLS] output."""

  config: ModelConfig

  @nn.compact
  def __call__(self, input_ids_BL: Array, token_type_ids_BL: Array | None = None,
               attention_mask_BL: Array | None = None, deterministic: bool = True) -> Array:
    cfg = self.config
    _, pooled_BD = BertModel(cfg, name="bert")(input_ids_BL, token_type_ids_BL,
                                               attention_mask_BL, deterministic)
    pooled_BD = classification_head(cfg, pooled_BD, deterministic)
    pooled_BD = Dropout(cfg.hidden_dropout, cfg.dropout_rng)(pooled_BD,
                                                             deterministic=deterministic)
    logits_BC = layers.Dense(cfg, "bd,dc->bc", (cfg.hidden_size, cfg.num_labels),
                             ("embed", None), (cfg.num_labels,), (None,),
                             name="classifier")(pooled_BD)
    return logits_BC.astype(jnp.float32)


class BertForTokenClassification(nn.Module):
  """BERT with dropout and a linear classifier on every token's output (NER-style tagging).

  Parameters: `bert` (the encoder, pooler included though unused, so that a pre-trained
  checkpoint's tree fits unchanged) and `classifier`; logits [B, L, num_labels] in fp32.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, input_ids_BL: Array, token_type_ids_BL: Array | None = None,
               attention_mask_BL: Array | None = None, deterministic: bool = True) -> Array:
    cfg = self.config
    sequence_BLD, _ = BertModel(cfg, name="bert")(input_ids_BL, token_type_ids_BL,
                                                  attention_mask_BL, deterministic)
    sequence_BLD = prediction_head(cfg, sequence_BLD)
    sequence_BLD = Dropout(cfg.hidden_dropout, cfg.dropout_rng)(sequence_BLD,
                                                                deterministic=deterministic)
    return per_token_logits(cfg, sequence_BLD, cfg.num_labels, "classifier")


class BertForQuestionAnswering(nn.Module):
  """BERT with a linear span head on every token (SQuAD, Devlin et al. 2019 §4.2): the start and
  end logits of the answer span, [B, L, 2] in fp32 (`[..., 0]` start, `[..., 1]` end), as
  Hugging Face's BertForQuestionAnswering (`qa_outputs`, no dropout before it).

  Parameters: `bert` (pooler included though unused, so a pre-trained checkpoint's tree fits
  unchanged) and `qa_outputs`."""

  config: ModelConfig

  @nn.compact
  def __call__(self, input_ids_BL: Array, token_type_ids_BL: Array | None = None,
               attention_mask_BL: Array | None = None, deterministic: bool = True) -> Array:
    cfg = self.config
    sequence_BLD, _ = BertModel(cfg, name="bert")(input_ids_BL, token_type_ids_BL,
                                                  attention_mask_BL, deterministic)
    return per_token_logits(cfg, prediction_head(cfg, sequence_BLD), 2, "qa_outputs")
