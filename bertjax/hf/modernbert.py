"""ModernBERT's mapping: parameter names of ModernBertForMaskedLM / ModernBertModel, the bertjax
parameters they lack, and its config.json both ways (transformers 4's and 5's keys).

PyTorch nn.Linear stores [out, in]: kernels are transposed; the fused Wqkv and the gated Wi
are reshaped to bertjax's [D, 3, N, H] and [D, 2, F] kernels.
"""

from __future__ import annotations

from typing import Any

from bertjax.hf import bert
from bertjax.hf.entries import HF_ACT, Entry, HFConversionError, norm, same, transposed
from bertjax.hf.formats import HFFormat
from bertjax.models import ModelConfig

# Where the Hugging Face models keep the encoder under the head: its tensors' name prefix.
PREFIX = "model."

# What a BERT-family config must say to be a ModernBERT (ModernBertForMaskedLM's layout).
_MODERNBERT = {"norm_position": "pre", "final_layer_norm": True, "type_vocab_size": 0,
               "position_embedding": "rotary", "mlp_gated": True, "pooler": False,
               "first_attention_norm": False}


def entries(cfg: ModelConfig, prefix: str) -> list[Entry]:
  """ModernBertForMaskedLM: `model.` (embeddings, layers, final_norm), `head` (the MLM
  transform) and `decoder` (tied to the embedding; its bias is ours `mlm_bias`). Layer 0 has
  no attn_norm; biases exist only where the config says."""
  d, n, h, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
  nb = cfg.norm_bias
  entries = [
      same(("bert", "word_embeddings", "embedding"), f"{prefix}embeddings.tok_embeddings.weight"),
      *norm(("bert", "embeddings_norm"), f"{prefix}embeddings.norm", bias=nb),
      *norm(("bert", "final_norm"), f"{prefix}final_norm", bias=nb),
      transposed(("mlm_transform", "kernel"), "head.dense.weight", True),
      *norm(("mlm_norm",), "head.norm", True, bias=nb),
      same(("mlm_bias",), "decoder.bias", True),
  ]
  if cfg.head_bias:
    entries.append(same(("mlm_transform", "bias"), "head.dense.bias", True))
  for i in range(cfg.num_layers):
    ours = ("bert", "encoder", f"layers_{i}")
    hf = f"{prefix}layers.{i}."
    if i or cfg.first_attention_norm:
      entries += norm(ours + ("attention_norm",), f"{hf}attn_norm", bias=nb)
    entries += [
        Entry(ours + ("attention", "qkv", "kernel"), (f"{hf}attn.Wqkv.weight",),
              lambda w: w.T.reshape(d, 3, n, h), lambda x: (x.reshape(d, 3 * d).T,)),
        Entry(ours + ("attention", "out", "kernel"), (f"{hf}attn.Wo.weight",),
              lambda w: w.T.reshape(n, h, d), lambda x: (x.reshape(d, d).T,)),
        *norm(ours + ("mlp_norm",), f"{hf}mlp_norm", bias=nb),
        Entry(ours + ("mlp", "wi", "kernel"), (f"{hf}mlp.Wi.weight",),
              lambda w: w.T.reshape(d, 2, f), lambda x: (x.reshape(d, 2 * f).T,)),
        transposed(ours + ("mlp", "wo", "kernel"), f"{hf}mlp.Wo.weight"),
    ]
    if cfg.attention_bias:
      entries += [Entry(ours + ("attention", "qkv", "bias"), (f"{hf}attn.Wqkv.bias",),
                        lambda b: b.reshape(3, n, h), lambda x: (x.reshape(3 * d),)),
                  same(ours + ("attention", "out", "bias"), f"{hf}attn.Wo.bias")]
    if cfg.mlp_bias:
      entries += [Entry(ours + ("mlp", "wi", "bias"), (f"{hf}mlp.Wi.bias",),
                        lambda b: b.reshape(2, f), lambda x: (x.reshape(2 * f),)),
                  same(ours + ("mlp", "wo", "bias"), f"{hf}mlp.Wo.bias")]
  return entries


def without_equivalent(cfg: ModelConfig) -> list[tuple[str, ...]]:
  """bertjax parameters ModernBERT lacks: it has no NSP head, and its layer 0 no attention norm
  (whose scale a scanned stack still holds, unused)."""
  keys = [("nsp", "kernel"), ("nsp", "bias")]
  if not cfg.first_attention_norm:
    attention_norm = ("bert", "encoder", "layers_0", "attention_norm")
    keys += [attention_norm + ("scale",)] + (
        [attention_norm + ("bias",)] if cfg.norm_bias else [])
  return keys


def tied_copies(prefix: str) -> dict[str, str]:
  """Checkpoint tensors that copy another (bertjax ties them): copy -> original."""
  return {"decoder.weight": f"{prefix}embeddings.tok_embeddings.weight"}


def _layout(hf: dict[str, Any]) -> tuple[int, float, float]:
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


def config_from_hf(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
  """A ModelConfig equivalent to a ModernBERT config.json (`common`: the keys every family
  shares)."""
  act = hf.get("hidden_activation", "gelu")
  if act not in HF_ACT:
    raise HFConversionError(f"hidden_activation={act!r} is not supported ({', '.join(HF_ACT)})")
  if hf.get("classifier_activation", act) != act:
    raise HFConversionError(f"classifier_activation={hf['classifier_activation']!r} differs "
                            f"from hidden_activation={act!r}; bertjax's head uses one")
  if not hf.get("decoder_bias", True):
    raise HFConversionError("decoder_bias=false is not supported (bertjax's MLM decoder has a "
                            "bias)")
  every, global_theta, local_theta = _layout(hf)
  return ModelConfig(
      family="bert", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
      mlp_dim=hf["intermediate_size"], max_positions=hf["max_position_embeddings"],
      type_vocab_size=0, norm_position="pre", final_layer_norm=True, activation=HF_ACT[act],
      layer_norm_eps=hf.get("norm_eps", 1e-5),
      hidden_dropout=max(hf.get("embedding_dropout", 0.0), hf.get("mlp_dropout", 0.0)),
      attention_dropout=hf.get("attention_dropout", 0.0), position_embedding="rotary",
      rope_theta=global_theta, local_rope_theta=local_theta, mlp_gated=True,
      attention_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False),
      norm_bias=hf.get("norm_bias", False), head_bias=hf.get("classifier_bias", False),
      pooler=False, local_window=int(hf.get("local_attention", 128)), global_every=every,
      first_attention_norm=False, **common)


def check_exportable(cfg: ModelConfig) -> None:
  """Raises unless a rotary BERT config has ModernBertForMaskedLM's layout."""
  bert.check_unshared(cfg)
  wrong = [f"{k}={getattr(cfg, k)!r}" for k, v in _MODERNBERT.items() if getattr(cfg, k) != v]
  if wrong or not cfg.local_window:
    raise HFConversionError("a rotary BERT exports as ModernBERT, which needs "
                            + ", ".join(f"{k}={v!r}" for k, v in _MODERNBERT.items())
                            + " and a local_window; this config has "
                            + ", ".join(wrong or ["local_window=0"]))


def config_dict(cfg: ModelConfig, dtype: str, act: str) -> dict[str, Any]:
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


FORMATS = (HFFormat(
    model_type="modernbert", family="bert", prefix=PREFIX,
    entries=lambda cfg, prefix, head, tensors: entries(cfg, prefix),
    tied_copies=tied_copies, config_from_hf=config_from_hf,
    config_dict=lambda cfg, r: {**config_dict(cfg, r.dtype, r.activation),
                                **(r.generation_ids or {})},
    claims=lambda cfg: cfg.family == "bert" and cfg.position_embedding == "rotary",
    priority=20, check_exportable=check_exportable,
    heads={"pretraining": "ModernBertForMaskedLM"},
    without_equivalent=lambda cfg, head: without_equivalent(cfg)),)
