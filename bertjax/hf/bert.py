"""BERT's mapping: parameter names of BertForPreTraining / BertForMaskedLM / BertModel and of the
fine-tuning heads (BertForSequenceClassification, BertForTokenClassification,
BertForQuestionAnswering), and its config.json both ways.

PyTorch nn.Linear stores [out, in]: kernels are transposed; bertjax fuses Q, K, V into one
[D, 3, N, H] kernel and keeps heads as their own axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bertjax.hf.entries import (
  HF_ACT,
  Entry,
  HFConversionError,
  check_classic,
  fused_qkv,
  norm,
  same,
  transposed,
)
from bertjax.hf.formats import HFFormat, PeftLayout
from bertjax.models import ModelConfig

# Where the Hugging Face models keep the encoder under the heads: its tensors' name prefix.
PREFIX = "bert."

# What an exported BERT carries on top of the encoder: the pre-training heads, or a fine-tuning
# classifier on the pooled [CLS] output / on every token (bertjax.models.bert).
EXPORT_HEADS = {"pretraining": "BertForPreTraining",
                "sequence_classification": "BertForSequenceClassification",
                "token_classification": "BertForTokenClassification",
                "question_answering": "BertForQuestionAnswering"}
# Heads on every token: Hugging Face's models have no pooler under them.
TOKEN_HEADS = ("token_classification", "question_answering")


def embedding_entries(prefix: str) -> list[Entry]:
  """The word, position and token-type tables and their LayerNorm (`{prefix}embeddings.`):
  BERT's, and ELECTRA's alike."""
  e = f"{prefix}embeddings."
  return [
      same(("bert", "word_embeddings", "embedding"), f"{e}word_embeddings.weight"),
      same(("bert", "position_embeddings", "embedding"), f"{e}position_embeddings.weight"),
      same(("bert", "token_type_embeddings", "embedding"), f"{e}token_type_embeddings.weight"),
      *norm(("bert", "embeddings_norm"), f"{e}LayerNorm"),
  ]


def entries(cfg: ModelConfig, prefix: str) -> list[Entry]:
  entries = embedding_entries(prefix) + [
      transposed(("bert", "pooler", "kernel"), f"{prefix}pooler.dense.weight", optional=True),
      same(("bert", "pooler", "bias"), f"{prefix}pooler.dense.bias", optional=True),
      transposed(("mlm_transform", "kernel"), "cls.predictions.transform.dense.weight", True),
      same(("mlm_transform", "bias"), "cls.predictions.transform.dense.bias", True),
      *norm(("mlm_norm",), "cls.predictions.transform.LayerNorm", True),
      same(("mlm_bias",), "cls.predictions.bias", True),
      transposed(("nsp", "kernel"), "cls.seq_relationship.weight", True),
      same(("nsp", "bias"), "cls.seq_relationship.bias", True),
  ]
  return entries + layer_entries(cfg, prefix)


@dataclasses.dataclass(frozen=True)
class LayerNames:
  """Where an encoder layer's tensors are, under `{prefix}` + `layer` (formatted with the layer
  index): BERT's by default."""

  layer: str = "encoder.layer.{}."
  # The query/key/value projections: `qkv` formatted with each of `qkv_names`.
  qkv: str = "attention.self.{}"
  qkv_names: tuple[str, str, str] = ("query", "key", "value")
  out: str = "attention.output.dense"
  attention_norm: str = "attention.output.LayerNorm"
  wi: str = "intermediate.dense"
  wo: str = "output.dense"
  mlp_norm: str = "output.LayerNorm"


def block_entries(cfg: ModelConfig, ours: tuple[str, ...], hf: str,
                  names: LayerNames = LayerNames(), projection: str = "{}") -> list[Entry]:
  """One encoder layer: our subtree `ours` <-> their tensors under `hf` (the layer's prefix),
  named by `names`; `projection` names the query/key/value projections within `names.qkv`."""
  d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  qkv = tuple(hf + names.qkv.format(projection.format(t)) for t in names.qkv_names)
  return [
      *fused_qkv(ours + ("attention", "qkv"), qkv, d, n, h),
      Entry(ours + ("attention", "out", "kernel"), (f"{hf}{names.out}.weight",),
            lambda w: w.T.reshape(n, h, d), lambda x: (x.reshape(d, d).T,)),
      same(ours + ("attention", "out", "bias"), f"{hf}{names.out}.bias"),
      *norm(ours + ("attention_norm",), f"{hf}{names.attention_norm}"),
      transposed(ours + ("mlp", "wi", "kernel"), f"{hf}{names.wi}.weight"),
      same(ours + ("mlp", "wi", "bias"), f"{hf}{names.wi}.bias"),
      transposed(ours + ("mlp", "wo", "kernel"), f"{hf}{names.wo}.weight"),
      same(ours + ("mlp", "wo", "bias"), f"{hf}{names.wo}.bias"),
      *norm(ours + ("mlp_norm",), f"{hf}{names.mlp_norm}"),
  ]


def layer_entries(cfg: ModelConfig, prefix: str, projection: str = "{}",
                  names: LayerNames = LayerNames()) -> list[Entry]:
  """The encoder's layers (`layers_{i}` <-> `{prefix}` + `names.layer`): BERT's, and
  ELECTRA's, DeBERTa's and DistilBERT's alike (DeBERTa's `projection`: "{}_proj")."""
  return [entry for i in range(cfg.num_layers)
          for entry in block_entries(cfg, ("bert", "encoder", f"layers_{i}"),
                                     prefix + names.layer.format(i), names, projection)]


def classifier_entries(cfg: ModelConfig, head: str) -> list[Entry]:
  """The encoder (no pre-training heads; no pooler under a per-token head, as Hugging Face's
  BertForTokenClassification and BertForQuestionAnswering have none) plus the head:
  `classifier.weight` / `classifier.bias`, or the span head `qa_outputs.weight` / `.bias`."""
  encoder = [e for e in entries(cfg, PREFIX) if e.ours[0] == "bert"]
  if head in TOKEN_HEADS:
    encoder = [e for e in encoder if e.ours[:2] != ("bert", "pooler")]
  name = "qa_outputs" if head == "question_answering" else "classifier"
  return encoder + [transposed((name, "kernel"), f"{name}.weight"),
                    same((name, "bias"), f"{name}.bias")]


def tied_copies(prefix: str) -> dict[str, str]:
  """Checkpoint tensors that copy another (bertjax ties them): copy -> original."""
  return {"cls.predictions.decoder.weight": f"{prefix}embeddings.word_embeddings.weight",
          "cls.predictions.decoder.bias": "cls.predictions.bias"}


def config_from_hf(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
  """A ModelConfig equivalent to a BERT config.json (`common`: the keys every family shares)."""
  if hf.get("position_embedding_type", "absolute") != "absolute":
    raise HFConversionError(f"position_embedding_type={hf['position_embedding_type']!r} is "
                            "not supported (only 'absolute')")
  act = hf.get("hidden_act", "gelu")
  if act not in HF_ACT:
    raise HFConversionError(f"hidden_act={act!r} is not supported ({', '.join(HF_ACT)})")
  return ModelConfig(
      family="bert", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
      mlp_dim=hf["intermediate_size"], max_positions=hf["max_position_embeddings"],
      type_vocab_size=hf["type_vocab_size"], norm_position="post", activation=HF_ACT[act],
      layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
      hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
      attention_dropout=hf.get("attention_probs_dropout_prob", 0.1), **common)


def label_keys(cfg: ModelConfig, head: str, labels: list[str] | None) -> dict[str, Any]:
  """A classifier's config.json keys: its labels (names in id order; default LABEL_i) and the
  problem type (one output of a sequence head: regression)."""
  labels = list(labels) if labels is not None else [f"LABEL_{i}" for i in
                                                    range(cfg.num_labels)]
  if len(labels) != cfg.num_labels:
    raise ValueError(f"{len(labels)} label names for num_labels={cfg.num_labels}")
  problem = ("regression" if cfg.num_labels == 1 and head == "sequence_classification"
             else "single_label_classification")
  return {"num_labels": cfg.num_labels,
          "id2label": {str(i): name for i, name in enumerate(labels)},
          "label2id": {name: i for i, name in enumerate(labels)},
          "problem_type": problem, "classifier_dropout": None}


def config_dict(cfg: ModelConfig, dtype: str, act: str, head: str = "pretraining",
                labels: list[str] | None = None) -> dict[str, Any]:
  """BertForPreTraining's config.json, or that of the fine-tuning model of `head` (`act`: the
  Hugging Face activation name; `head`, `labels`: see export_hf)."""
  if head == "question_answering":
    # qa_outputs: two outputs per token (start, end), HF's num_labels for this head.
    return {**config_dict(cfg, dtype, act), "architectures": [EXPORT_HEADS[head]],
            "num_labels": 2}
  if head != "pretraining":
    return {**config_dict(cfg, dtype, act), "architectures": [EXPORT_HEADS[head]],
            **label_keys(cfg, head, labels)}
  return {
      "architectures": ["BertForPreTraining"], "model_type": "bert",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "intermediate_size": cfg.mlp_dim, "hidden_act": act,
      "hidden_dropout_prob": cfg.hidden_dropout,
      "attention_probs_dropout_prob": cfg.attention_dropout,
      "max_position_embeddings": cfg.max_positions, "type_vocab_size": cfg.type_vocab_size,
      "initializer_range": cfg.initializer_range, "layer_norm_eps": cfg.layer_norm_eps,
      "pad_token_id": 0, "position_embedding_type": "absolute", "tie_word_embeddings": True,
      "torch_dtype": dtype}


def check_unshared(cfg: ModelConfig) -> None:
  """Only ALBERT's layout shares layers in transformers."""
  if cfg.layer_sharing != "none":
    raise HFConversionError(f"model.layer_sharing={cfg.layer_sharing}: transformers' "
                            f"{cfg.architecture} has no shared layers (model.architecture=albert "
                            "exports as ALBERT)")


def check_exportable(cfg: ModelConfig) -> None:
  """Raises unless `cfg` is BertForPreTraining's layout."""
  check_unshared(cfg)
  check_classic(cfg, "BertForPreTraining")
  if cfg.norm_position != "post":
    raise HFConversionError("pre-LN BERT has no Hugging Face BertForPreTraining equivalent")


def _entries(cfg: ModelConfig, prefix: str, head: str, tensors: Any) -> list[Entry]:
  del tensors
  return entries(cfg, prefix) if head == "pretraining" else classifier_entries(cfg, head)


def _without_equivalent(cfg: ModelConfig, head: str) -> list[tuple[str, ...]]:
  """The pooler under a per-token head: trained by nothing there; HF's model has none."""
  if head not in TOKEN_HEADS:
    return []
  return [e.ours for e in entries(cfg, PREFIX) if e.ours[:2] == ("bert", "pooler")]


FORMATS = (HFFormat(
    model_type="bert", family="bert", prefix=PREFIX, entries=_entries, tied_copies=tied_copies,
    config_from_hf=config_from_hf,
    config_dict=lambda cfg, r: config_dict(cfg, r.dtype, r.activation, r.head, r.labels),
    claims=lambda cfg: cfg.family == "bert", check_exportable=check_exportable,
    heads=EXPORT_HEADS, without_equivalent=_without_equivalent,
    peft=PeftLayout(layer=PREFIX + "encoder.layer.{}.",
                    modules={"query": "attention.self.query", "key": "attention.self.key",
                             "value": "attention.self.value", "out": "attention.output.dense",
                             "wi": "intermediate.dense", "wo": "output.dense"},
                    fan_in_fan_out=False, task_heads=True)),)
