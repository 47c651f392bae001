"""Replaced-token detection (ELECTRA, Clark et al. 2020; DeBERTa-v3, He et al. 2023): a small MLM
generator and the discriminator it trains, one module and one parameter tree.

The tree is the discriminator's (`bert`, `discriminator_predictions`: what fine-tuning and the
`ElectraForPreTraining` export read) with the generator under `generator`, so dropping the
generator is dropping one key. Embedding sharing (`config.embedding_sharing`) is ELECTRA's
"shared" or DeBERTa-v3's gradient-disentangled "gdes"; `discriminator_params` adds a GDES
residual up into a plain encoder.

The guide: docs/models.md, 'ELECTRA, DeBERTa and replaced-token detection'.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import activations, layers
from bertjax.models.bert import BertModel, gather_positions
from bertjax.models.config import ModelConfig

Array = jax.Array

# The tables a "shared" generator reads from its discriminator (ELECTRA's `embeddings` scope).
SHARED_EMBEDDINGS = ("word_embeddings", "position_embeddings", "token_type_embeddings",
                     "embeddings_norm")


class DiscriminatorPredictions(nn.Module):
  """ELECTRA's discriminator head (dense, the model's activation, dense to one logit per
  token): [B, L] in fp32, > 0 meaning "replaced"."""

  config: ModelConfig

  @nn.compact
  def __call__(self, sequence_BLD: Array) -> Array:
    cfg = self.config
    d = cfg.hidden_size
    h = layers.Dense(cfg, "bld,de->ble", (d, d), ("embed", "mlp"), (d,), ("mlp",),
                     name="dense")(sequence_BLD)
    h = activations.activation_fn(cfg.activation)(h)
    logits_BL1 = layers.Dense(cfg, "ble,ec->blc", (d, 1), ("mlp", None), (1,), (None,),
                              name="dense_prediction")(h)
    return logits_BL1[..., 0].astype(jnp.float32)


class ElectraDiscriminator(nn.Module):
  """The discriminator alone (transformers' ElectraForPreTraining): encoder and the
  per-token "replaced" logits [B, L]."""

  config: ModelConfig

  @nn.compact
  def __call__(self, input_ids_BL: Array, token_type_ids_BL: Array | None = None,
               attention_mask_BL: Array | None = None, deterministic: bool = True) -> Array:
    sequence_BLD, _ = BertModel(self.config, name="bert")(input_ids_BL, token_type_ids_BL,
                                                          attention_mask_BL, deterministic)
    return DiscriminatorPredictions(self.config, name="discriminator_predictions")(
        sequence_BLD)


class _Generator(nn.Module):
  """The generator's own parameters: its encoder (without tables under "shared" sharing), its
  MLM head (as BertForPreTraining names it) and its output bias."""

  config: ModelConfig
  owns_embeddings: bool

  def setup(self) -> None:
    cfg = self.config
    self.bert = BertModel(cfg, shared_embeddings=self.owns_embeddings)
    e = cfg.embedding_width
    self.mlm_transform = layers.Dense(cfg, "bpd,de->bpe", (cfg.hidden_size, e), ("embed", None),
                                      (e,), (None,))
    self.mlm_norm = layers.layer_norm(cfg, "mlm_norm")
    self.mlm_bias = self.param("mlm_bias", nn.with_logical_partitioning(
        nn.initializers.zeros, ("vocab",)), (cfg.vocab_size,), cfg.weight_dtype)

  def head(self, h_BPD: Array) -> Array:
    return self.mlm_norm(activations.activation_fn("gelu")(self.mlm_transform(h_BPD)))


class RtdOutput(NamedTuple):
  generator_logits: Array  # [B, P, V] at the masked positions (fp32)
  discriminator_logits: Array  # [B, L] (fp32), > 0: "replaced"


class ReplacedTokenDetection(nn.Module):
  """Discriminator (`config`) and generator (`config.generator_config()`) in one module.

  `generate` gives the generator's MLM logits at the masked positions; `discriminate` the
  discriminator's per-token logits; `__call__` runs both on the same ids (initialisation).
  Sampling and the losses are the objective's (bertjax.training.objectives).
  """

  config: ModelConfig

  def setup(self) -> None:
    cfg = self.config
    if not cfg.has_generator:
      raise ValueError("replaced-token detection needs a generator: set "
                       "model.generator_hidden_size")
    gdes = cfg.embedding_sharing == "gdes"
    self.generator = _Generator(cfg.generator_config(), owns_embeddings=gdes)
    self.bert = BertModel(cfg, base_word_embeddings=(self.generator.bert.word_embeddings
                                                     if gdes else None))
    self.discriminator_predictions = DiscriminatorPredictions(cfg)

  def _table_owner(self) -> BertModel:
    return self.generator.bert if self.config.embedding_sharing == "gdes" else self.bert

  def generate(self, input_ids_BL: Array, token_type_ids_BL: Array | None,
               attention_mask_BL: Array | None, masked_positions_BP: Array,
               deterministic: bool = True) -> Array:
    gen = self.generator
    embedded = None
    if self.config.embedding_sharing == "shared":
      embedded = self.bert.embeddings(input_ids_BL, token_type_ids_BL, attention_mask_BL,
                                      deterministic)
    sequence_BLD, _ = gen.bert(input_ids_BL, token_type_ids_BL, attention_mask_BL,
                               deterministic, embedded_BLE=embedded)
    h_BPE = gen.head(gather_positions(sequence_BLD, masked_positions_BP))
    logits = self._table_owner().attend(h_BPE)
    logits = logits + gen.mlm_bias.astype(logits.dtype)[None, None, :]
    return layers.constrain(logits, ("batch", "length", "vocab")).astype(jnp.float32)

  def discriminate(self, input_ids_BL: Array, token_type_ids_BL: Array | None,
                   attention_mask_BL: Array | None, deterministic: bool = True) -> Array:
    sequence_BLD, _ = self.bert(input_ids_BL, token_type_ids_BL, attention_mask_BL,
                                deterministic)
    return self.discriminator_predictions(sequence_BLD)

  def __call__(self, input_ids_BL: Array, token_type_ids_BL: Array | None = None,
               attention_mask_BL: Array | None = None,
               masked_positions_BP: Array | None = None,
               deterministic: bool = True) -> RtdOutput:
    if masked_positions_BP is None:
      masked_positions_BP = jnp.zeros((input_ids_BL.shape[0], 1), jnp.int32)
    gen = self.generate(input_ids_BL, token_type_ids_BL, attention_mask_BL,
                        masked_positions_BP, deterministic)
    return RtdOutput(gen, self.discriminate(input_ids_BL, token_type_ids_BL, attention_mask_BL,
                                            deterministic))


def discriminator_params(params: Any, config: ModelConfig) -> Any:
  """The discriminator alone, as a plain encoder with its head: the generator dropped, a
  GDES residual added to the generator's word table."""
  params = dict(params)
  generator = params.pop("generator")
  if config.embedding_sharing == "gdes":
    bert = dict(params["bert"])
    residual = bert["word_embeddings"]["embedding"]
    base = generator["bert"]["word_embeddings"]["embedding"]
    bert["word_embeddings"] = {"embedding": (base + residual).astype(residual.dtype)}
    params["bert"] = bert
  return params


def generator_params(params: Any, config: ModelConfig) -> Any:
  """The generator alone, as a BertForPreTraining-shaped tree of `config.generator_config()`
  (`bert`, `mlm_transform`, `mlm_norm`, `mlm_bias`; no NSP head): the shared tables copied in
  under "shared" sharing."""
  generator = dict(params["generator"])
  if config.embedding_sharing == "shared":
    bert = dict(generator["bert"])
    for name in SHARED_EMBEDDINGS:
      if name in params["bert"]:
        bert[name] = params["bert"][name]
    generator["bert"] = bert
  return generator
