"""ALBERT's mapping: parameter names of AlbertForPreTraining, AlbertForMaskedLM and AlbertModel,
and its config.json (model_type "albert") both ways.

bertjax reads and writes two of transformers' layer groupings: one group of one layer shared by
every layer (`layer_sharing="all"`: `bert/encoder/shared_layer`, ALBERT as released) and one
group per layer (`layer_sharing="none"`); attention-only or FFN-only sharing (the paper's Table
4 ablations) has no transformers equivalent and is refused on export.

The guide: docs/models.md, 'Hugging Face names' (ALBERT).
"""

from __future__ import annotations

from typing import Any

from bertjax.hf import bert
from bertjax.hf.entries import Entry, HFConversionError, norm, same, transposed
from bertjax.hf.formats import HFFormat
from bertjax.models import ModelConfig

# Where the Hugging Face models keep the encoder under the heads: its tensors' name prefix.
PREFIX = "albert."

# bertjax head -> the transformers class it exports as ("encoder": the bare encoder).
EXPORT_HEADS = {"pretraining": "AlbertForPreTraining", "encoder": "AlbertModel"}

# What an ALBERT must say beyond architecture=albert to be transformers' (AlbertLayer's
# layout: BERT's post-LN layer with every bias; learned absolute positions).
_ALBERT = {"norm_position": "post", "position_embedding": "learned", "mlp_gated": False,
           "attention_bias": True, "mlp_bias": True, "norm_bias": True, "head_bias": True,
           "local_window": 0, "first_attention_norm": True}


def check_exportable(cfg: ModelConfig) -> None:
  """Raises, naming the setting, where transformers' ALBERT cannot hold `cfg`."""
  if cfg.layer_sharing not in ("all", "none"):
    raise HFConversionError(f"model.layer_sharing={cfg.layer_sharing}: transformers' ALBERT "
                            "shares whole layers or none (num_hidden_groups), so it exports "
                            "with layer_sharing all or none only")
  off = [f"{k}={getattr(cfg, k)!r}" for k, v in _ALBERT.items() if getattr(cfg, k) != v]
  if not cfg.type_vocab_size:
    off.append("type_vocab_size=0")
  if off:
    raise HFConversionError(f"{', '.join(off)}: no transformers ALBERT equivalent "
                            "(AlbertModel is post-LN with learned positions, token types and "
                            "every bias)")


def _groups(cfg: ModelConfig, prefix: str) -> list[tuple[tuple[str, ...], str]]:
  """(our layer subtree, their layer prefix) per stored layer: the shared one, or one each."""
  base = f"{prefix}encoder.albert_layer_groups."
  if cfg.layer_sharing == "all":
    return [(("bert", "encoder", "shared_layer"), f"{base}0.albert_layers.0.")]
  return [(("bert", "encoder", f"layers_{i}"), f"{base}{i}.albert_layers.0.")
          for i in range(cfg.num_layers)]


# AlbertLayer's tensors, under each stored layer's prefix (`_groups`): BERT's layer under
# other names.
LAYER_NAMES = bert.LayerNames(layer="", qkv="attention.{}", out="attention.dense",
                              attention_norm="attention.LayerNorm", wi="ffn", wo="ffn_output",
                              mlp_norm="full_layer_layer_norm")


def layer_entries(cfg: ModelConfig, prefix: str = PREFIX) -> list[Entry]:
  """The stored layers (the shared one, or one per layer) and their AlbertLayer tensors."""
  return [entry for ours, hf in _groups(cfg, prefix)
          for entry in bert.block_entries(cfg, ours, hf, LAYER_NAMES)]


def entries(cfg: ModelConfig, prefix: str = PREFIX) -> list[Entry]:
  """AlbertForPreTraining: the encoder under `prefix` (`albert.`; none in a bare AlbertModel's
  file) and the MLM and sentence-order heads (optional, as the pooler: AlbertModel has no heads,
  AlbertForMaskedLM no pooler or SOP head; those are freshly initialised on import)."""
  mapping = f"{prefix}encoder.embedding_hidden_mapping_in"
  return bert.embedding_entries(prefix) + [
      transposed(("bert", "embeddings_project", "kernel"), f"{mapping}.weight"),
      same(("bert", "embeddings_project", "bias"), f"{mapping}.bias"),
      *layer_entries(cfg, prefix),
      transposed(("bert", "pooler", "kernel"), f"{prefix}pooler.weight", True),
      same(("bert", "pooler", "bias"), f"{prefix}pooler.bias", True),
      transposed(("mlm_transform", "kernel"), "predictions.dense.weight", True),
      same(("mlm_transform", "bias"), "predictions.dense.bias", True),
      *norm(("mlm_norm",), "predictions.LayerNorm", True),
      same(("mlm_bias",), "predictions.bias", True),
      transposed(("nsp", "kernel"), "sop_classifier.classifier.weight", True),
      same(("nsp", "bias"), "sop_classifier.classifier.bias", True),
  ]


def tied_copies(prefix: str) -> dict[str, str]:
  """Checkpoint tensors that copy another (bertjax ties them): copy -> original."""
  return {"predictions.decoder.weight": f"{prefix}embeddings.word_embeddings.weight",
          "predictions.decoder.bias": "predictions.bias"}


def config_from_hf(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
  """A ModelConfig equivalent to an ALBERT config.json: BERT's keys, the embedding width, and
  the sharing its layer groups imply."""
  layers = hf["num_hidden_layers"]
  groups, inner = hf.get("num_hidden_groups", 1), hf.get("inner_group_num", 1)
  if inner != 1:
    raise HFConversionError(f"inner_group_num={inner} is not supported (1: a group is one "
                            "layer)")
  if groups not in (1, layers):
    raise HFConversionError(f"num_hidden_groups={groups} is not supported (1: every layer "
                            f"shares one, or num_hidden_layers={layers}: none shared)")
  embedding = hf.get("embedding_size", 128)
  return bert.config_from_hf(
      {"hidden_act": "gelu_new", "type_vocab_size": 2, "layer_norm_eps": 1e-12,
       "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **hf}, common).replace(
      architecture="albert", embedding_size=0 if embedding == hf["hidden_size"] else embedding,
      layer_sharing="all" if groups == 1 else "none")


def config_dict(cfg: ModelConfig, dtype: str, act: str, head: str = "pretraining",
                generation_ids: dict[str, int] | None = None) -> dict[str, Any]:
  """The config.json of `head`'s ALBERT class (`act`: the transformers activation name;
  `generation_ids`: the special ids of the run's tokenizer)."""
  check_exportable(cfg)
  if head not in EXPORT_HEADS:
    raise HFConversionError(f"head={head!r}: an ALBERT exports as one of "
                            f"{', '.join(EXPORT_HEADS.values())}")
  return {
      "architectures": [EXPORT_HEADS[head]], "model_type": "albert",
      "vocab_size": cfg.vocab_size, "embedding_size": cfg.embedding_width,
      "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
      "num_hidden_groups": 1 if cfg.layer_sharing == "all" else cfg.num_layers,
      "inner_group_num": 1, "num_attention_heads": cfg.num_heads,
      "intermediate_size": cfg.mlp_dim, "hidden_act": act,
      "hidden_dropout_prob": cfg.hidden_dropout,
      "attention_probs_dropout_prob": cfg.attention_dropout,
      "max_position_embeddings": cfg.max_positions, "type_vocab_size": cfg.type_vocab_size,
      "initializer_range": cfg.initializer_range, "layer_norm_eps": cfg.layer_norm_eps,
      "classifier_dropout_prob": 0.1, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3,
      "tie_word_embeddings": True, "torch_dtype": dtype, **(generation_ids or {})}


FORMATS = (HFFormat(
    model_type="albert", family="bert", prefix=PREFIX,
    entries=lambda cfg, prefix, head, tensors: entries(cfg, prefix),
    tied_copies=tied_copies, config_from_hf=config_from_hf,
    config_dict=lambda cfg, r: config_dict(cfg, r.dtype, r.activation, r.head,
                                           r.generation_ids),
    claims=lambda cfg: cfg.family == "bert" and cfg.architecture == "albert", priority=40,
    check_exportable=check_exportable, heads=EXPORT_HEADS),)
