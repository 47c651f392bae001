"""Hugging Face interop: bertjax parameters <-> `transformers` safetensors checkpoints.

Supported: BertForPreTraining, BertForMaskedLM and bare BertModel (missing heads are freshly
initialised and reported), ModernBertForMaskedLM / ModernBertModel, GPT2LMHeadModel /
GPT2Model, OpenAIGPTLMHeadModel / OpenAIGPTModel.
Fine-tuned BERT (bertjax.training.finetuning) exports as BertForSequenceClassification,
BertForTokenClassification or BertForQuestionAnswering (`head=`).
Only safetensors are read or written; nothing is unpickled. Every mismatch (unknown tensor,
wrong shape, missing tensor) is an error naming the tensor.

Layout differences handled here: PyTorch nn.Linear stores [out, in] (BERT: transposed);
GPT's Conv1D stores [in, out] (no transpose); bertjax fuses Q, K, V into one [D, 3, N, H]
kernel and keeps heads as their own axis; scanned models stack layers on a leading axis.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np
from etils import epath
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import save as save_safetensors

from bertjax import paths

from bertjax.hf import tokenizer as hf_tokenizer
from bertjax.models import ModelConfig, build_model, jit_init
from bertjax.models.params import stack_layers, unstack_layers

Flat = dict[tuple[str, ...], np.ndarray]

# Files a tokenizer may consist of; copied along on import and export. spm.model, spm.vocab and
# bertjax_tokenizer.json are bertjax's own (SentencePiece model, casing), so an exported
# directory imports back with the tokenizer the run trained.
TOKENIZER_FILES = ("vocab.txt", "vocab.json", "merges.txt", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "spiece.model",
                   "sentencepiece.model", "spm.model", "spm.vocab", "bertjax_tokenizer.json")

_HF_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
           "gelu_fast": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu"}


# What an exported BERT carries on top of the encoder: the pre-training heads, or a fine-tuning
# classifier on the pooled [CLS] output / on every token (bertjax.models.bert).
EXPORT_HEADS = {"pretraining": "BertForPreTraining",
                "sequence_classification": "BertForSequenceClassification",
                "token_classification": "BertForTokenClassification",
                "question_answering": "BertForQuestionAnswering"}
# Heads on every token: Hugging Face's models have no pooler under them.
_TOKEN_HEADS = ("token_classification", "question_answering")


class HFConversionError(ValueError):
  """A checkpoint that does not fit the model, naming the offending tensor."""


@dataclasses.dataclass
class ImportReport:
  model_type: str
  architecture: str
  # bertjax parameters that had no tensor in the checkpoint and were freshly initialised.
  fresh: list[str] = dataclasses.field(default_factory=list)
  # Checkpoint entries intentionally not loaded (buffers, tied copies).
  ignored: list[str] = dataclasses.field(default_factory=list)

  def summary(self) -> str:
    lines = [f"imported {self.architecture} ({self.model_type})"]
    if self.fresh:
      lines.append(f"freshly initialised (absent from the checkpoint): {', '.join(self.fresh)}")
    if self.ignored:
      lines.append(f"ignored (buffers or tied copies): {len(self.ignored)} tensors")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One bertjax parameter and the checkpoint tensor(s) it is made of."""

  ours: tuple[str, ...]
  theirs: tuple[str, ...]
  to_ours: Callable[..., np.ndarray]
  to_theirs: Callable[[np.ndarray], tuple[np.ndarray, ...]]
  # Heads may be absent from a checkpoint (a bare BertModel): then freshly initialised.
  optional: bool = False


def _same(name: tuple[str, ...], hf: str, optional: bool = False) -> Entry:
  return Entry(name, (hf,), lambda x: x, lambda x: (x,), optional)


def _transposed(name: tuple[str, ...], hf: str, optional: bool = False) -> Entry:
  return Entry(name, (hf,), lambda x: x.T, lambda x: (x.T,), optional)


def _norm(name: tuple[str, ...], hf: str, optional: bool = False,
          bias: bool = True) -> list[Entry]:
  return [_same(name + ("scale",), f"{hf}.weight", optional)] + (
      [_same(name + ("bias",), f"{hf}.bias", optional)] if bias else [])


def _bert_entries(cfg: ModelConfig, prefix: str) -> list[Entry]:
  d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  e = f"{prefix}embeddings."
  entries = [
      _same(("bert", "word_embeddings", "embedding"), f"{e}word_embeddings.weight"),
      _same(("bert", "position_embeddings", "embedding"), f"{e}position_embeddings.weight"),
      _same(("bert", "token_type_embeddings", "embedding"), f"{e}token_type_embeddings.weight"),
      *_norm(("bert", "embeddings_norm"), f"{e}LayerNorm"),
      _transposed(("bert", "pooler", "kernel"), f"{prefix}pooler.dense.weight", optional=True),
      _same(("bert", "pooler", "bias"), f"{prefix}pooler.dense.bias", optional=True),
      _transposed(("mlm_transform", "kernel"), "cls.predictions.transform.dense.weight", True),
      _same(("mlm_transform", "bias"), "cls.predictions.transform.dense.bias", True),
      *_norm(("mlm_norm",), "cls.predictions.transform.LayerNorm", True),
      _same(("mlm_bias",), "cls.predictions.bias", True),
      _transposed(("nsp", "kernel"), "cls.seq_relationship.weight", True),
      _same(("nsp", "bias"), "cls.seq_relationship.bias", True),
  ]
  for i in range(cfg.num_layers):
    ours = ("bert", "encoder", f"layers_{i}")
    hf = f"{prefix}encoder.layer.{i}."
    qkv = tuple(f"{hf}attention.self.{t}" for t in ("query", "key", "value"))
    entries += [
        Entry(ours + ("attention", "qkv", "kernel"), tuple(f"{q}.weight" for q in qkv),
              lambda q, k, v: np.stack([q.T, k.T, v.T], axis=1).reshape(d, 3, n, h),
              lambda x: tuple(x.reshape(d, 3, d)[:, t].T for t in range(3))),
        Entry(ours + ("attention", "qkv", "bias"), tuple(f"{q}.bias" for q in qkv),
              lambda q, k, v: np.stack([q, k, v]).reshape(3, n, h),
              lambda x: tuple(x.reshape(3, d))),
        Entry(ours + ("attention", "out", "kernel"), (f"{hf}attention.output.dense.weight",),
              lambda w: w.T.reshape(n, h, d), lambda x: (x.reshape(d, d).T,)),
        _same(ours + ("attention", "out", "bias"), f"{hf}attention.output.dense.bias"),
        *_norm(ours + ("attention_norm",), f"{hf}attention.output.LayerNorm"),
        _transposed(ours + ("mlp", "wi", "kernel"), f"{hf}intermediate.dense.weight"),
        _same(ours + ("mlp", "wi", "bias"), f"{hf}intermediate.dense.bias"),
        _transposed(ours + ("mlp", "wo", "kernel"), f"{hf}output.dense.weight"),
        _same(ours + ("mlp", "wo", "bias"), f"{hf}output.dense.bias"),
        *_norm(ours + ("mlp_norm",), f"{hf}output.LayerNorm"),
    ]
  return entries


def _modernbert_entries(cfg: ModelConfig, prefix: str) -> list[Entry]:
  """ModernBertForMaskedLM: `model.` (embeddings, layers, final_norm), `head` (the MLM
  transform) and `decoder` (tied to the embedding; its bias is ours `mlm_bias`). Layer 0 has
  no attn_norm; biases exist only where the config says."""
  d, n, h, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
  nb = cfg.norm_bias
  entries = [
      _same(("bert", "word_embeddings", "embedding"), f"{prefix}embeddings.tok_embeddings.weight"),
      *_norm(("bert", "embeddings_norm"), f"{prefix}embeddings.norm", bias=nb),
      *_norm(("bert", "final_norm"), f"{prefix}final_norm", bias=nb),
      _transposed(("mlm_transform", "kernel"), "head.dense.weight", True),
      *_norm(("mlm_norm",), "head.norm", True, bias=nb),
      _same(("mlm_bias",), "decoder.bias", True),
  ]
  if cfg.head_bias:
    entries.append(_same(("mlm_transform", "bias"), "head.dense.bias", True))
  for i in range(cfg.num_layers):
    ours = ("bert", "encoder", f"layers_{i}")
    hf = f"{prefix}layers.{i}."
    if i or cfg.first_attention_norm:
      entries += _norm(ours + ("attention_norm",), f"{hf}attn_norm", bias=nb)
    entries += [
        Entry(ours + ("attention", "qkv", "kernel"), (f"{hf}attn.Wqkv.weight",),
              lambda w: w.T.reshape(d, 3, n, h), lambda x: (x.reshape(d, 3 * d).T,)),
        Entry(ours + ("attention", "out", "kernel"), (f"{hf}attn.Wo.weight",),
              lambda w: w.T.reshape(n, h, d), lambda x: (x.reshape(d, d).T,)),
        *_norm(ours + ("mlp_norm",), f"{hf}mlp_norm", bias=nb),
        Entry(ours + ("mlp", "wi", "kernel"), (f"{hf}mlp.Wi.weight",),
              lambda w: w.T.reshape(d, 2, f), lambda x: (x.reshape(d, 2 * f).T,)),
        _transposed(ours + ("mlp", "wo", "kernel"), f"{hf}mlp.Wo.weight"),
    ]
    if cfg.attention_bias:
      entries += [Entry(ours + ("attention", "qkv", "bias"), (f"{hf}attn.Wqkv.bias",),
                        lambda b: b.reshape(3, n, h), lambda x: (x.reshape(3 * d),)),
                  _same(ours + ("attention", "out", "bias"), f"{hf}attn.Wo.bias")]
    if cfg.mlp_bias:
      entries += [Entry(ours + ("mlp", "wi", "bias"), (f"{hf}mlp.Wi.bias",),
                        lambda b: b.reshape(2, f), lambda x: (x.reshape(2 * f),)),
                  _same(ours + ("mlp", "wo", "bias"), f"{hf}mlp.Wo.bias")]
  return entries


def _without_equivalent(cfg: ModelConfig, model_type: str) -> list[tuple[str, ...]]:
  """bertjax parameters a Hugging Face model of `model_type` lacks: left out of an export,
  taken from a fresh init on import. ModernBERT has no NSP head, and its layer 0 no attention
  norm (whose scale a scanned stack still holds, unused)."""
  if model_type != "modernbert":
    return []
  keys = [("nsp", "kernel"), ("nsp", "bias")]
  if not cfg.first_attention_norm:
    norm = ("bert", "encoder", "layers_0", "attention_norm")
    keys += [norm + ("scale",)] + ([norm + ("bias",)] if cfg.norm_bias else [])
  return keys


def _gpt_entries(cfg: ModelConfig, prefix: str, gpt1: bool) -> list[Entry]:
  d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  wte, wpe = ("tokens_embed", "positions_embed") if gpt1 else ("wte", "wpe")
  entries = [_same(("wte", "embedding"), f"{prefix}{wte}.weight"),
             _same(("wpe", "embedding"), f"{prefix}{wpe}.weight")]
  if not gpt1:
    entries += _norm(("final_norm",), f"{prefix}ln_f")
  for i in range(cfg.num_layers):
    ours = ("decoder", f"layers_{i}")
    hf = f"{prefix}h.{i}."
    # Conv1D weights are [in, out] like a Flax kernel: reshapes only, no transposes.
    entries += [
        Entry(ours + ("attention", "qkv", "kernel"), (f"{hf}attn.c_attn.weight",),
              lambda w: w.reshape(d, 3, n, h), lambda x: (x.reshape(d, 3 * d),)),
        Entry(ours + ("attention", "qkv", "bias"), (f"{hf}attn.c_attn.bias",),
              lambda b: b.reshape(3, n, h), lambda x: (x.reshape(3 * d),)),
        Entry(ours + ("attention", "out", "kernel"), (f"{hf}attn.c_proj.weight",),
              lambda w: w.reshape(n, h, d), lambda x: (x.reshape(d, d),)),
        _same(ours + ("attention", "out", "bias"), f"{hf}attn.c_proj.bias"),
        *_norm(ours + ("attention_norm",), f"{hf}ln_1"),
        _same(ours + ("mlp", "wi", "kernel"), f"{hf}mlp.c_fc.weight"),
        _same(ours + ("mlp", "wi", "bias"), f"{hf}mlp.c_fc.bias"),
        _same(ours + ("mlp", "wo", "kernel"), f"{hf}mlp.c_proj.weight"),
        _same(ours + ("mlp", "wo", "bias"), f"{hf}mlp.c_proj.bias"),
        *_norm(ours + ("mlp_norm",), f"{hf}ln_2"),
    ]
  return entries


def _entries(cfg: ModelConfig, model_type: str, prefix: str) -> list[Entry]:
  if model_type == "bert":
    return _bert_entries(cfg, prefix)
  if model_type == "modernbert":
    return _modernbert_entries(cfg, prefix)
  return _gpt_entries(cfg, prefix, gpt1=model_type == "openai-gpt")


def _flat_numpy(params: Any) -> Flat:
  params = nn.meta.unbox(params)
  return {k: np.asarray(jax.device_get(v)) for k, v in traverse_util.flatten_dict(params).items()}


# --- configs -----------------------------------------------------------------------------

def model_config_from_hf(hf: dict[str, Any], scan_layers: bool = True) -> ModelConfig:
  """A ModelConfig equivalent to a `transformers` config.json."""
  model_type = hf.get("model_type")
  common = dict(scan_layers=scan_layers, initializer_range=hf.get("initializer_range", 0.02))
  if model_type == "bert":
    if hf.get("position_embedding_type", "absolute") != "absolute":
      raise HFConversionError(f"position_embedding_type={hf['position_embedding_type']!r} is "
                              "not supported (only 'absolute')")
    act = hf.get("hidden_act", "gelu")
    if act not in _HF_ACT:
      raise HFConversionError(f"hidden_act={act!r} is not supported ({', '.join(_HF_ACT)})")
    return ModelConfig(
        family="bert", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        mlp_dim=hf["intermediate_size"], max_positions=hf["max_position_embeddings"],
        type_vocab_size=hf["type_vocab_size"], norm_position="post", activation=_HF_ACT[act],
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1), **common)
  if model_type == "modernbert":
    return _modernbert_config(hf, common)
  if model_type in ("gpt2", "openai-gpt"):
    gpt1 = model_type == "openai-gpt"
    act = hf.get("afn" if gpt1 else "activation_function", "gelu" if gpt1 else "gelu_new")
    if gpt1 and act == "gelu":
      act = "gelu_new"  # OpenAIGPT's "gelu" is the tanh approximation (its ACT_FNS table)
    if act not in _HF_ACT:
      raise HFConversionError(f"activation {act!r} is not supported ({', '.join(_HF_ACT)})")
    if not gpt1 and (not hf.get("scale_attn_weights", True)
                     or hf.get("scale_attn_by_inverse_layer_idx", False)):
      raise HFConversionError("GPT-2 attention scaling variants (scale_attn_weights=False, "
                              "scale_attn_by_inverse_layer_idx=True) are not supported")
    d = hf["n_embd"]
    return ModelConfig(
        family="gpt", vocab_size=hf["vocab_size"], hidden_size=d, num_layers=hf["n_layer"],
        num_heads=hf["n_head"], mlp_dim=hf.get("n_inner") or 4 * d,
        max_positions=hf["n_positions"], type_vocab_size=0,
        norm_position="post" if gpt1 else "pre", final_layer_norm=not gpt1,
        activation=_HF_ACT[act], layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
        scale_residual_init=not gpt1, **common)
  raise HFConversionError(f"unsupported model_type {model_type!r} (bert, modernbert, gpt2, "
                          "openai-gpt)")


def _modernbert_layout(hf: dict[str, Any]) -> tuple[int, float, float]:
  """(global_every, global rope theta, local rope theta) of a ModernBERT config.json, written
  by transformers 5 (layer_types, rope_parameters) or 4 (global_attn_every_n_layers,
  global_rope_theta, local_rope_theta)."""
  every = int(hf.get("global_attn_every_n_layers", 3))
  types = hf.get("layer_types")
  if types:
    fulls = [i for i, t in enumerate(types) if t == "full_attention"]
    every = fulls[1] - fulls[0] if len(fulls) > 1 else len(types)
    expected = ["sliding_attention" if i % every else "full_attention" for i in range(len(types))]
    if types != expected:
      raise HFConversionError(f"layer_types {types} is not a global layer every n layers "
                              "from layer 0, the only pattern bertjax runs")
  rope = hf.get("rope_parameters") or {}
  global_theta = (rope.get("full_attention") or {}).get(
      "rope_theta", hf.get("global_rope_theta", 160_000.0))
  local_theta = (rope.get("sliding_attention") or {}).get(
      "rope_theta", hf.get("local_rope_theta", 10_000.0))
  for kind in ("full_attention", "sliding_attention"):
    rope_type = (rope.get(kind) or {}).get("rope_type", "default")
    if rope_type != "default":
      raise HFConversionError(f"rope_type {rope_type!r} ({kind}) is not supported (default)")
  return every, float(global_theta), float(local_theta)


def _modernbert_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
  act = hf.get("hidden_activation", "gelu")
  if act not in _HF_ACT:
    raise HFConversionError(f"hidden_activation={act!r} is not supported ({', '.join(_HF_ACT)})")
  if hf.get("classifier_activation", act) != act:
    raise HFConversionError(f"classifier_activation={hf['classifier_activation']!r} differs "
                            f"from hidden_activation={act!r}; bertjax's head uses one")
  if not hf.get("decoder_bias", True):
    raise HFConversionError("decoder_bias=false is not supported (bertjax's MLM decoder has a "
                            "bias)")
  every, global_theta, local_theta = _modernbert_layout(hf)
  return ModelConfig(
      family="bert", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
      mlp_dim=hf["intermediate_size"], max_positions=hf["max_position_embeddings"],
      type_vocab_size=0, norm_position="pre", final_layer_norm=True, activation=_HF_ACT[act],
      layer_norm_eps=hf.get("norm_eps", 1e-5),
      hidden_dropout=max(hf.get("embedding_dropout", 0.0), hf.get("mlp_dropout", 0.0)),
      attention_dropout=hf.get("attention_dropout", 0.0), position_embedding="rotary",
      rope_theta=global_theta, local_rope_theta=local_theta, mlp_gated=True,
      attention_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False),
      norm_bias=hf.get("norm_bias", False), head_bias=hf.get("classifier_bias", False),
      pooler=False, local_window=int(hf.get("local_attention", 128)), global_every=every,
      first_attention_norm=False, **common)


# What a BERT-family config must say to be a ModernBERT (ModernBertForMaskedLM's layout).
_MODERNBERT = dict(norm_position="pre", final_layer_norm=True, type_vocab_size=0,
                   position_embedding="rotary", mlp_gated=True, pooler=False,
                   first_attention_norm=False)


def _hf_model_type(cfg: ModelConfig) -> str:
  if cfg.family == "bert" and cfg.position_embedding == "rotary":
    wrong = [f"{k}={getattr(cfg, k)!r}" for k, v in _MODERNBERT.items() if getattr(cfg, k) != v]
    if wrong or not cfg.local_window:
      raise HFConversionError("a rotary BERT exports as ModernBERT, which needs "
                              + ", ".join(f"{k}={v!r}" for k, v in _MODERNBERT.items())
                              + " and a local_window; this config has "
                              + ", ".join(wrong or ["local_window=0"]))
    return "modernbert"
  modern = [name for name, classic in (("position_embedding", "learned"), ("mlp_gated", False),
                                        ("pooler", True), ("attention_bias", True),
                                        ("mlp_bias", True), ("norm_bias", True),
                                        ("head_bias", True), ("local_window", 0))
            if getattr(cfg, name) != classic]
  if modern:
    raise HFConversionError(f"{', '.join(f'{n}={getattr(cfg, n)!r}' for n in modern)}: no "
                            f"{'BertForPreTraining' if cfg.family == 'bert' else 'GPT-2'} "
                            "equivalent in transformers (MosaicBERT is remote code; a rotary "
                            "BERT exports as ModernBERT)")
  if cfg.family == "bert":
    if cfg.norm_position != "post":
      raise HFConversionError("pre-LN BERT has no Hugging Face BertForPreTraining equivalent")
    return "bert"
  if cfg.norm_position == "pre" and cfg.final_layer_norm:
    return "gpt2"
  if cfg.norm_position == "post" and not cfg.final_layer_norm and cfg.activation == "gelu_tanh":
    return "openai-gpt"
  raise HFConversionError(
      f"GPT with norm_position={cfg.norm_position!r}, final_layer_norm={cfg.final_layer_norm},"
      f" activation={cfg.activation!r} matches neither GPT2LMHeadModel nor OpenAIGPTLMHeadModel")


def _default_generation_ids(cfg: ModelConfig) -> dict[str, int]:
  """GPT-2's convention, its last id is <|endoftext|>: only a default for a GPT exported without
  a bertjax tokenizer (an imported GPT-2), since a bertjax SentencePiece vocabulary puts
  <|endoftext|> at 1 and `vocab_size - 1` is an ordinary piece there."""
  return {"bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1}


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32", head: str = "pretraining",
                   labels: list[str] | None = None,
                   generation_ids: dict[str, int] | None = None) -> dict[str, Any]:
  """The config.json `transformers` needs to load the exported weights (`head`, `labels`: see
  export_hf). `generation_ids`: the special ids of the run's tokenizer
  (`hf_tokenizer.generation_ids`): a GPT's bos/eos(/pad)_token_id, where generation stops
  (default GPT-2's `vocab_size - 1`), or a ModernBERT's pad/cls/sep."""
  _check_head(cfg, head)
  model_type = _hf_model_type(cfg)
  act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[
      cfg.activation]
  if model_type == "modernbert":
    return {**_modernbert_config_dict(cfg, dtype, act), **(generation_ids or {})}
  if model_type == "bert" and head == "question_answering":
    # qa_outputs: two outputs per token (start, end), HF's num_labels for this head.
    return {**hf_config_dict(cfg, dtype), "architectures": [EXPORT_HEADS[head]], "num_labels": 2}
  if model_type == "bert" and head != "pretraining":
    labels = list(labels) if labels is not None else [f"LABEL_{i}" for i in
                                                      range(cfg.num_labels)]
    if len(labels) != cfg.num_labels:
      raise ValueError(f"{len(labels)} label names for num_labels={cfg.num_labels}")
    config = hf_config_dict(cfg, dtype)
    problem = ("regression" if cfg.num_labels == 1 and head == "sequence_classification"
               else "single_label_classification")
    config.update({"architectures": [EXPORT_HEADS[head]], "num_labels": cfg.num_labels,
                   "id2label": {str(i): name for i, name in enumerate(labels)},
                   "label2id": {name: i for i, name in enumerate(labels)},
                   "problem_type": problem, "classifier_dropout": None})
    return config
  if model_type == "bert":
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
  common = {"vocab_size": cfg.vocab_size, "n_positions": cfg.max_positions,
            "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout, "layer_norm_epsilon": cfg.layer_norm_eps,
            "initializer_range": cfg.initializer_range, "tie_word_embeddings": True,
            "torch_dtype": dtype}
  if model_type == "openai-gpt":
    common.update(generation_ids or {})
    if cfg.mlp_dim != 4 * cfg.hidden_size:
      raise HFConversionError("OpenAIGPT requires mlp_dim == 4 * hidden_size")
    # OpenAIGPT's afn "gelu" is the tanh approximation.
    return {"architectures": ["OpenAIGPTLMHeadModel"], "model_type": "openai-gpt",
            "afn": "gelu", **common}
  return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_inner": cfg.mlp_dim,
          "activation_function": act, **(generation_ids or _default_generation_ids(cfg)),
          **common}


def _modernbert_config_dict(cfg: ModelConfig, dtype: str, act: str) -> dict[str, Any]:
  """ModernBertForMaskedLM's config.json: transformers 5's layer_types and rope_parameters,
  and the keys transformers 4 reads (global_attn_every_n_layers, *_rope_theta). Dropout:
  bertjax's hidden_dropout is ModernBERT's embedding and MLP dropout."""
  types = ["sliding_attention" if cfg.is_local(i) else "full_attention"
           for i in range(cfg.num_layers)]
  local_theta = cfg.local_rope_theta or cfg.rope_theta
  return {
      "architectures": ["ModernBertForMaskedLM"], "model_type": "modernbert",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "hidden_activation": act,
      "classifier_activation": act, "max_position_embeddings": cfg.max_positions,
      "norm_eps": cfg.layer_norm_eps, "norm_bias": cfg.norm_bias,
      "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias,
      "classifier_bias": cfg.head_bias, "decoder_bias": True,
      "local_attention": cfg.local_window, "global_attn_every_n_layers": cfg.global_every,
      "layer_types": types, "global_rope_theta": cfg.rope_theta, "local_rope_theta": local_theta,
      "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                          "sliding_attention": {"rope_type": "default",
                                                "rope_theta": local_theta}},
      "embedding_dropout": cfg.hidden_dropout, "mlp_dropout": cfg.hidden_dropout,
      "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.initializer_range,
      "tie_word_embeddings": True, "sparse_prediction": False, "torch_dtype": dtype,
      # Without a tokenizer to name them: [PAD] at 0 (bertjax's BERT vocabularies), the rest
      # unknown (transformers' defaults are ModernBERT's own vocabulary's ids).
      "pad_token_id": 0, "cls_token_id": None, "sep_token_id": None, "bos_token_id": None,
      "eos_token_id": None}


# --- export ------------------------------------------------------------------------------

def _classifier_entries(cfg: ModelConfig, head: str) -> list[Entry]:
  """The encoder (no pre-training heads; no pooler under a per-token head, as Hugging Face's
  BertForTokenClassification and BertForQuestionAnswering have none) plus the head:
  `classifier.weight` / `classifier.bias`, or the span head `qa_outputs.weight` / `.bias`."""
  entries = [e for e in _bert_entries(cfg, "bert.") if e.ours[0] == "bert"]
  if head in _TOKEN_HEADS:
    entries = [e for e in entries if e.ours[:2] != ("bert", "pooler")]
  name = "qa_outputs" if head == "question_answering" else "classifier"
  return entries + [_transposed((name, "kernel"), f"{name}.weight"),
                    _same((name, "bias"), f"{name}.bias")]


def _check_head(cfg: ModelConfig, head: str) -> None:
  if head not in EXPORT_HEADS:
    raise ValueError(f"head must be one of {', '.join(EXPORT_HEADS)}, got {head!r}")
  if head != "pretraining" and cfg.family != "bert":
    raise HFConversionError(f"head={head!r} is for BERT; this is a {cfg.family} model")


def to_hf_state_dict(params: Any, cfg: ModelConfig,
                     head: str = "pretraining") -> dict[str, np.ndarray]:
  """bertjax parameters -> `transformers` tensor names (tied copies omitted). `head`: the
  parameters' heads, one of EXPORT_HEADS (fine-tuned models: a classification head)."""
  _check_head(cfg, head)
  model_type = _hf_model_type(cfg)
  if model_type == "modernbert" and head != "pretraining":
    raise HFConversionError(f"head={head!r}: a ModernBERT exports as ModernBertForMaskedLM "
                            "only")
  prefix = {"bert": "bert.", "modernbert": "model.", "gpt2": "transformer.",
            "openai-gpt": "transformer."}[model_type]
  flat = unstack_layers(_flat_numpy(params), cfg)
  for key in _without_equivalent(cfg, model_type):
    flat.pop(key, None)
  tensors: dict[str, np.ndarray] = {}
  entries = _entries(cfg, model_type, prefix)
  if head != "pretraining":
    entries = _classifier_entries(cfg, head)
    if head in _TOKEN_HEADS:
      # The pooler is trained by nothing under a per-token head; HF's model has none.
      for key in [k for k in flat if k[:2] == ("bert", "pooler")]:
        flat.pop(key)
  for entry in entries:
    if entry.ours not in flat:
      raise HFConversionError(f"bertjax parameter {'/'.join(entry.ours)} is missing")
    for name, value in zip(entry.theirs, entry.to_theirs(flat.pop(entry.ours))):
      tensors[name] = np.ascontiguousarray(value)
  if flat:
    raise HFConversionError(f"bertjax parameters with no Hugging Face equivalent: "
                            f"{', '.join('/'.join(k) for k in flat)}")
  return tensors


def export_hf(params: Any, cfg: ModelConfig, out_dir: paths.PathLike, dtype: str = "float32",
              tokenizer_dir: str | Path | None = None, head: str = "pretraining",
              labels: list[str] | None = None) -> epath.Path:
  """Writes config.json + model.safetensors (+ tokenizer files) loadable by `transformers`.

  With `tokenizer_dir` (a bertjax tokenizer: spm.model or vocab.txt) the directory also gets
  tokenizer.json, tokenizer_config.json and special_tokens_map.json that AutoTokenizer reads
  with bertjax's ids (`hf_tokenizer`), the tokenizer's own files, and a GPT's config.json names
  its <|endoftext|> / <pad> ids for generation.

  `head`: "pretraining" (BertForPreTraining / the GPT LM head models), or for fine-tuned BERT
  "sequence_classification" / "token_classification" (BertForSequenceClassification /
  BertForTokenClassification, with `labels`, names in id order, written as id2label) or
  "question_answering" (BertForQuestionAnswering)."""
  out = paths.path(out_dir)  # local or an object store
  out.mkdir(parents=True, exist_ok=True)
  tensors = to_hf_state_dict(params, cfg, head)
  if dtype == "bfloat16":
    import ml_dtypes  # jax dependency; numpy has no bfloat16 of its own
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
  elif dtype != "float32":
    raise ValueError(f"export dtype must be float32 or bfloat16, got {dtype!r}")
  (out / "model.safetensors").write_bytes(save_safetensors(tensors, metadata={"format": "pt"}))
  config = hf_config_dict(cfg, dtype, head, labels, hf_tokenizer.generation_ids(tokenizer_dir))
  (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  if tokenizer_dir is not None:
    export_tokenizer(tokenizer_dir, out, cfg.max_positions)
  return out


def export_tokenizer(tokenizer_dir: str | Path, out: paths.PathLike,
                     model_max_length: int) -> list[str]:
  """The tokenizer files of `tokenizer_dir` plus, for a bertjax tokenizer, the Hugging Face
  files built from it (which replace any copied ones: they must match the ids)."""
  copied = copy_tokenizer_files(tokenizer_dir, out)
  source = Path(tokenizer_dir)
  if (source / "spm.model").is_file() or (source / "vocab.txt").is_file():
    written = hf_tokenizer.write_hf_tokenizer(tokenizer_dir, out, model_max_length)
    copied = sorted(set(copied) | set(written))
  return copied


def copy_tokenizer_files(src: paths.PathLike, dst: paths.PathLike) -> list[str]:
  """The tokenizer files `transformers` reads, from `src` to `dst` (either local or remote)."""
  copied = []
  for name in TOKENIZER_FILES:
    if (paths.path(src) / name).is_file():
      (paths.path(dst) / name).write_bytes((paths.path(src) / name).read_bytes())
      copied.append(name)
  return copied


# --- import ------------------------------------------------------------------------------

def read_safetensors(hf_dir: str | Path) -> dict[str, np.ndarray]:
  """All tensors of model.safetensors or of a sharded model.safetensors.index.json."""
  hf_dir = Path(hf_dir)
  index = hf_dir / "model.safetensors.index.json"
  if index.exists():
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
  elif (hf_dir / "model.safetensors").exists():
    files = ["model.safetensors"]
  else:
    pickles = [p.name for p in hf_dir.glob("*.bin")] + [p.name for p in hf_dir.glob("*.pt")]
    hint = (f" ({', '.join(pickles)} are pickles, which bertjax never loads: convert them with "
            "`transformers` save_pretrained(safe_serialization=True))") if pickles else ""
    raise FileNotFoundError(f"no model.safetensors in {hf_dir}{hint}")
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    # framework="flax" reads bfloat16 too; numpy has no bfloat16 of its own.
    with safe_open(str(hf_dir / name), framework="flax") as f:
      for key in f.keys():
        tensors[key] = np.asarray(f.get_tensor(key), dtype=np.float32)
  return tensors


def _normalise_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Legacy TF-converted checkpoints name LayerNorm parameters gamma/beta."""
  out = {}
  for key, value in tensors.items():
    if key.endswith(".gamma"):
      key = key[:-len("gamma")] + "weight"
    elif key.endswith(".beta"):
      key = key[:-len("beta")] + "bias"
    out[key] = value
  return out


def _ignored(name: str) -> bool:
  # position_ids: a persistent buffer of old BERT files; attn.bias / attn.masked_bias: the
  # causal-mask buffers of old GPT-2 files.
  return (name.endswith("position_ids") or name.endswith(".attn.bias")
          or name.endswith(".attn.masked_bias"))


def from_hf_state_dict(tensors: dict[str, np.ndarray], cfg: ModelConfig, model_type: str,
                       fresh_params: Any) -> tuple[Any, list[str], list[str]]:
  """Checkpoint tensors -> bertjax parameters; heads absent from the checkpoint come from
  `fresh_params`. Returns (params, fresh parameter names, ignored tensor names)."""
  tensors = _normalise_names(tensors)
  if model_type == "bert":
    prefix = "bert." if any(k.startswith("bert.") for k in tensors) else ""
    tied = {"cls.predictions.decoder.weight": f"{prefix}embeddings.word_embeddings.weight",
            "cls.predictions.decoder.bias": "cls.predictions.bias"}
  elif model_type == "modernbert":
    prefix = "model." if any(k.startswith("model.") for k in tensors) else ""
    tied = {"decoder.weight": f"{prefix}embeddings.tok_embeddings.weight"}
  else:
    prefix = "transformer." if any(k.startswith("transformer.") for k in tensors) else ""
    tied = {"lm_head.weight": f"{prefix}{'tokens_embed' if model_type == 'openai-gpt' else 'wte'}"
                              ".weight"}
  ignored = [k for k in tensors if _ignored(k)]
  for copy, original in tied.items():
    if copy in tensors:
      if original in tensors and not np.array_equal(tensors[copy], tensors[original]):
        raise HFConversionError(f"{copy} is not tied to {original}; bertjax ties them")
      ignored.append(copy)
  ignored_set = set(ignored)
  remaining = {k: v for k, v in tensors.items() if k not in ignored_set}
  fresh_flat = unstack_layers(_flat_numpy(fresh_params), cfg)
  flat: Flat = {}
  fresh: list[str] = []
  for entry in _entries(cfg, model_type, prefix):
    present = [name in remaining for name in entry.theirs]
    if not all(present):
      if entry.optional and not any(present):
        flat[entry.ours] = fresh_flat[entry.ours]
        fresh.append("/".join(entry.ours))
        continue
      missing = [n for n, p in zip(entry.theirs, present) if not p]
      raise HFConversionError(f"tensor {missing[0]} is missing from the checkpoint "
                              f"(needed for bertjax parameter {'/'.join(entry.ours)})")
    _check_shapes(entry, tensors, fresh_flat)
    value = entry.to_ours(*(remaining.pop(name) for name in entry.theirs))
    flat[entry.ours] = value.astype(fresh_flat[entry.ours].dtype)
  for key in _without_equivalent(cfg, model_type):
    if key in fresh_flat:
      flat[key] = fresh_flat[key]
      if key[0] != "bert":  # a head; the unused layer-0 norm goes unmentioned
        fresh.append("/".join(key))
  if remaining:
    raise HFConversionError(f"unknown tensor {sorted(remaining)[0]} in the checkpoint "
                            f"({len(remaining)} unknown in all: {', '.join(sorted(remaining)[:8])})")
  params = traverse_util.unflatten_dict(stack_layers(flat, cfg))
  return params, fresh, ignored


def _check_shapes(entry: Entry, tensors: dict[str, np.ndarray], fresh_flat: Flat) -> None:
  """Checks each source tensor's shape against what the config implies; raises by name."""
  expected = entry.to_theirs(fresh_flat[entry.ours])
  for name, want in zip(entry.theirs, expected):
    got = tensors[name].shape
    if tuple(got) != tuple(want.shape):
      raise HFConversionError(f"tensor {name} has shape {tuple(got)}, expected "
                              f"{tuple(want.shape)} for this config")


def import_hf(hf_dir: str | Path, scan_layers: bool = True, rng: jax.Array | None = None,
              drop: tuple[str, ...] = ()) -> tuple[Any, ModelConfig, ImportReport]:
  """Reads a `transformers` directory (config.json + safetensors; local or an object store)
  into bertjax parameters. Tensors whose names start with a prefix in `drop` (a fine-tuned
  checkpoint's `classifier.`) are left out and reported as ignored."""
  hf_dir = paths.local_copy(hf_dir)
  config_path = hf_dir / "config.json"
  if not config_path.exists():
    raise FileNotFoundError(f"no config.json in {hf_dir}")
  hf_config = json.loads(config_path.read_text())
  cfg = model_config_from_hf(hf_config, scan_layers)
  model_type = hf_config["model_type"]
  architecture = (hf_config.get("architectures") or ["?"])[0]
  tensors = read_safetensors(hf_dir)
  dropped = sorted(k for k in tensors if k.startswith(drop)) if drop else []
  tensors = {k: v for k, v in tensors.items() if k not in set(dropped)}
  rng = jax.random.key(0) if rng is None else rng
  fresh_params = jit_init(build_model(cfg))(rng)
  params, fresh, ignored = from_hf_state_dict(tensors, cfg, model_type, fresh_params)
  return params, cfg, ImportReport(model_type, architecture, fresh, dropped + ignored)

