"""DistilBERT's mapping (Sanh et al. 2019): parameter names of DistilBertForMaskedLM /
DistilBertModel, and its config.json both ways.

DistilBERT is BERT without token types and pooler (and without the NSP head): in bertjax a
BERT-family ModelConfig with `type_vocab_size=0` and `pooler=False` (`matches`); the NSP head
is left out of an export and freshly initialised on import (`without_equivalent`). The shared
converter (bertjax/hf/convert.py) dispatches here by model type "distilbert"; the layers are
BERT's mapping under DistilBERT's names (`LAYER_NAMES`).

The guide: docs/models.md, 'DistilBERT'.
"""

from __future__ import annotations

from typing import Any

from bertjax.hf import bert
from bertjax.hf.entries import HF_ACT, Entry, HFConversionError, norm, same, transposed
from bertjax.hf.formats import HFFormat
from bertjax.models import ModelConfig

PREFIX = "distilbert."
MODEL_TYPE = "distilbert"
ARCHITECTURE = "DistilBertForMaskedLM"
# Where a layer's tensors are, under `{prefix}transformer.layer.{i}.`.
LAYER_NAMES = bert.LayerNames(layer="transformer.layer.{}.", qkv="attention.{}_lin",
                              qkv_names=("q", "k", "v"), out="attention.out_lin",
                              attention_norm="sa_layer_norm", wi="ffn.lin1", wo="ffn.lin2",
                              mlp_norm="output_layer_norm")
# transformers' DistilBERT fixes every LayerNorm's eps at 1e-12 (no config key).
LAYER_NORM_EPS = 1e-12


def matches(cfg: ModelConfig) -> bool:
  """Whether `cfg` is DistilBERT-shaped: a BERT encoder without token types and pooler (what
  exports as DistilBertForMaskedLM rather than BertForPreTraining)."""
  return (cfg.family == "bert" and cfg.architecture == "bert" and not cfg.pooler
          and cfg.type_vocab_size == 0 and not cfg.has_generator)


def check_exportable(cfg: ModelConfig) -> None:
  """An HFConversionError naming what a DistilBERT-shaped config has that DistilBERT has not."""
  bert.check_unshared(cfg)
  classic = (("position_embedding", "learned"), ("norm_position", "post"),
             ("mlp_gated", False), ("attention_bias", True), ("mlp_bias", True),
             ("norm_bias", True), ("head_bias", True), ("local_window", 0),
             ("embedding_size", 0), ("layer_norm_eps", LAYER_NORM_EPS))
  other = [f"{name}={getattr(cfg, name)!r}" for name, value in classic
           if getattr(cfg, name) != value]
  if other:
    raise HFConversionError(f"{', '.join(other)}: no DistilBertForMaskedLM equivalent "
                            "(DistilBERT: learned positions, post-LN, biases everywhere, "
                            f"LayerNorm eps {LAYER_NORM_EPS})")


def entries(cfg: ModelConfig, prefix: str = PREFIX) -> list[Entry]:
  """Every bertjax parameter of a DistilBERT-shaped BertForPreTraining but the NSP head, and
  the DistilBertForMaskedLM tensor(s) it is made of (its MLM head optional: a bare
  DistilBertModel has none)."""
  e = f"{prefix}embeddings."
  out = [same(("bert", "word_embeddings", "embedding"), f"{e}word_embeddings.weight"),
         same(("bert", "position_embeddings", "embedding"), f"{e}position_embeddings.weight"),
         *norm(("bert", "embeddings_norm"), f"{e}LayerNorm"),
         transposed(("mlm_transform", "kernel"), "vocab_transform.weight", True),
         same(("mlm_transform", "bias"), "vocab_transform.bias", True),
         *norm(("mlm_norm",), "vocab_layer_norm", True),
         same(("mlm_bias",), "vocab_projector.bias", True)]
  return out + bert.layer_entries(cfg, prefix, names=LAYER_NAMES)


def without_equivalent() -> list[tuple[str, ...]]:
  """bertjax parameters DistilBertForMaskedLM lacks: BertForPreTraining's NSP head (trained by
  nothing without sentence pairs)."""
  return [("nsp", "kernel"), ("nsp", "bias")]


def tied_copies(prefix: str = PREFIX) -> dict[str, str]:
  """Checkpoint tensors that copy another (bertjax ties them): copy -> original."""
  return {"vocab_projector.weight": f"{prefix}embeddings.word_embeddings.weight"}


def config_from_hf(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
  """A ModelConfig equivalent to a DistilBERT config.json (`common`: the keys every family
  shares). The position table is read from the checkpoint whatever `sinusoidal_pos_embds`
  says (transformers stores it either way)."""
  act = hf.get("activation", "gelu")
  if act not in HF_ACT:
    raise HFConversionError(f"activation={act!r} is not supported ({', '.join(HF_ACT)})")
  return ModelConfig(
      family="bert", vocab_size=hf["vocab_size"], hidden_size=hf["dim"],
      num_layers=hf["n_layers"], num_heads=hf["n_heads"], mlp_dim=hf["hidden_dim"],
      max_positions=hf["max_position_embeddings"], type_vocab_size=0, norm_position="post",
      activation=HF_ACT[act], layer_norm_eps=LAYER_NORM_EPS, pooler=False,
      hidden_dropout=hf.get("dropout", 0.1), attention_dropout=hf.get("attention_dropout", 0.1),
      **common)


def config_dict(cfg: ModelConfig, dtype: str, act: str) -> dict[str, Any]:
  """DistilBertForMaskedLM's config.json (`act`: the transformers activation name)."""
  check_exportable(cfg)
  return {
      "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
      "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_positions,
      "sinusoidal_pos_embds": False, "n_layers": cfg.num_layers, "n_heads": cfg.num_heads,
      "dim": cfg.hidden_size, "hidden_dim": cfg.mlp_dim, "dropout": cfg.hidden_dropout,
      "attention_dropout": cfg.attention_dropout, "activation": act,
      "initializer_range": cfg.initializer_range, "qa_dropout": 0.1,
      "seq_classif_dropout": 0.2, "pad_token_id": 0, "tie_weights_": True,
      "tie_word_embeddings": True, "torch_dtype": dtype}


FORMATS = (HFFormat(
    model_type=MODEL_TYPE, family="bert", prefix=PREFIX,
    entries=lambda cfg, prefix, head, tensors: entries(cfg, prefix),
    tied_copies=tied_copies, config_from_hf=config_from_hf,
    config_dict=lambda cfg, r: config_dict(cfg, r.dtype, r.activation),
    claims=matches, priority=10, check_exportable=check_exportable,
    heads={"pretraining": ARCHITECTURE},
    without_equivalent=lambda cfg, head: without_equivalent()),)
