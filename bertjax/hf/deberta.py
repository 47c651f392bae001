"""DeBERTa-v2/v3's mapping: parameter names of DebertaV2ForMaskedLM / DebertaV2Model, the
bertjax parameters they lack, and its config.json (model_type "deberta-v2") both ways.

The MLM head has two layouts in transformers, chosen by the config's `legacy` (default True):
`cls.predictions.transform.dense/LayerNorm` + `cls.predictions.bias` (legacy, with a decoder tied
to the word table and to that bias) and `lm_predictions.lm_head.dense/LayerNorm/bias` (Microsoft's
checkpoints; legacy=False). With embedding_size = hidden_size both compute dense, activation,
LayerNorm, the word table transposed, a bias: bertjax's MLM head. Import reads either (by the
tensors' names), export writes lm_predictions with legacy=False. Not implemented, refused by
name: absolute positions in the input (position_biased_input), the convolution of DeBERTa-v2's
first layer (conv_kernel_size), attention without relative positions.
"""

from __future__ import annotations

from typing import Any

from bertjax.hf import bert
from bertjax.hf.entries import HF_ACT, Entry, HFConversionError, norm, same, transposed
from bertjax.hf.formats import ExportRequest, HFFormat
from bertjax.models import ModelConfig

# Where the Hugging Face models keep the encoder under the head: its tensors' name prefix.
PREFIX = "deberta."
LEGACY_HEAD = "cls.predictions."
HEAD = "lm_predictions.lm_head."

# What a BERT-family config must say to be a DeBERTa-v2 (DebertaV2ForMaskedLM's layout); the
# architecture itself implies position_embedding=relative and pooler=False.
_DEBERTA = {"norm_position": "post", "mlp_gated": False, "attention_bias": True,
            "mlp_bias": True, "norm_bias": True, "head_bias": True, "local_window": 0,
            "first_attention_norm": True}


def is_legacy(tensors: dict[str, Any]) -> bool:
  """Whether a checkpoint's MLM head has the legacy names (cls.predictions.*)."""
  return any(k.startswith(LEGACY_HEAD) for k in tensors)


def entries(cfg: ModelConfig, prefix: str, legacy: bool = False) -> list[Entry]:
  """DebertaV2ForMaskedLM: `deberta.` (embeddings, encoder with its relative position table and
  that table's LayerNorm, layers) and the MLM head (optional: a bare DebertaV2Model has none) in
  the legacy or the lm_predictions layout."""
  d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  e, enc = f"{prefix}embeddings.", f"{prefix}encoder."
  head = f"{LEGACY_HEAD}transform." if legacy else HEAD
  entries = [
      same(("bert", "word_embeddings", "embedding"), f"{e}word_embeddings.weight"),
      *norm(("bert", "embeddings_norm"), f"{e}LayerNorm"),
      same(("bert", "encoder", "rel_embeddings", "embedding"), f"{enc}rel_embeddings.weight"),
      transposed(("mlm_transform", "kernel"), f"{head}dense.weight", True),
      same(("mlm_transform", "bias"), f"{head}dense.bias", True),
      *norm(("mlm_norm",), f"{head}LayerNorm", True),
      same(("mlm_bias",), f"{LEGACY_HEAD}bias" if legacy else f"{HEAD}bias", True),
  ]
  if cfg.type_vocab_size:
    entries.append(same(("bert", "token_type_embeddings", "embedding"),
                        f"{e}token_type_embeddings.weight"))
  if cfg.relative_embedding_norm:
    entries += norm(("bert", "encoder", "rel_embeddings_norm"), f"{enc}LayerNorm")
  terms = cfg.relative_attention_terms.split("|")
  # Their own position projections (share_att_key false): only those of the terms in use.
  positional = [] if cfg.share_attention_key else [
      (t, name) for t, name in (("c2p", "pos_key_proj"), ("p2c", "pos_query_proj")) if t in terms]
  entries += bert.layer_entries(cfg, prefix, projection="{}_proj")
  for i in range(cfg.num_layers):
    ours = ("bert", "encoder", f"layers_{i}")
    hf = f"{enc}layer.{i}."
    for _, name in positional:
      proj = f"{hf}attention.self.{name}"
      entries += [
          Entry(ours + ("attention", name, "kernel"), (f"{proj}.weight",),
                lambda w: w.T.reshape(d, n, h), lambda x: (x.reshape(d, d).T,)),
          Entry(ours + ("attention", name, "bias"), (f"{proj}.bias",),
                lambda b: b.reshape(n, h), lambda x: (x.reshape(d),)),
      ]
  return entries


# A fine-tuned DeBERTa's head -> its transformers class and tensors (bertjax name, theirs).
TASK_HEADS = {
    "sequence_classification": ("DebertaV2ForSequenceClassification",
                                (("head_dense", "pooler.dense"), ("classifier", "classifier"))),
    "token_classification": ("DebertaV2ForTokenClassification",
                             (("classifier", "classifier"),)),
    "question_answering": ("DebertaV2ForQuestionAnswering", (("qa_outputs", "qa_outputs"),)),
}


def task_entries(cfg: ModelConfig, head: str) -> list[Entry]:
  """A fine-tuned DeBERTa: the encoder and its task head (the sequence head's dense + GELU is
  transformers' ContextPooler, `pooler.dense`)."""
  encoder = [e for e in entries(cfg, PREFIX) if e.ours[0] == "bert"]
  return encoder + [entry for ours, theirs in TASK_HEADS[head][1]
                    for entry in (transposed((ours, "kernel"), f"{theirs}.weight"),
                                  same((ours, "bias"), f"{theirs}.bias"))]


def without_equivalent(cfg: ModelConfig) -> list[tuple[str, ...]]:
  """bertjax parameters DeBERTa lacks: its NSP head."""
  del cfg
  return [("nsp", "kernel"), ("nsp", "bias")]


def tied_copies(prefix: str) -> dict[str, str]:
  """Checkpoint tensors that copy another (bertjax ties them): the legacy head's decoder."""
  return {f"{LEGACY_HEAD}decoder.weight": f"{prefix}embeddings.word_embeddings.weight",
          f"{LEGACY_HEAD}decoder.bias": f"{LEGACY_HEAD}bias"}


def ignored(name: str) -> bool:
  """Tensors transformers itself skips on load (_keys_to_ignore_on_load_unexpected): an
  absolute position table (unused with position_biased_input false) and the replaced-token
  detection head of Microsoft's DeBERTa-v3 checkpoints (mask_predictions)."""
  return "position_embeddings" in name or name.startswith("mask_predictions.")


def _terms(hf: dict[str, Any]) -> str:
  """pos_att_type (a list, or transformers' older "p2c|c2p" string) as bertjax's terms."""
  types = hf.get("pos_att_type") or []
  if isinstance(types, str):
    types = types.split("|")
  types = [t.strip().lower() for t in types]
  unknown = [t for t in types if t not in ("c2p", "p2c")]
  if unknown or not types:
    raise HFConversionError(f"pos_att_type={hf.get('pos_att_type')!r} is not supported (a "
                            "non-empty combination of c2p and p2c)")
  return "|".join(t for t in ("c2p", "p2c") if t in types)


def config_from_hf(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
  """A ModelConfig equivalent to a DeBERTa-v2 config.json (`common`: the keys every family
  shares). Absent keys take transformers' defaults (getattr defaults included:
  position_buckets -1, share_att_key false, norm_rel_ebd "none")."""
  d, heads = hf["hidden_size"], hf["num_attention_heads"]
  refused = {
      "relative_attention": (not hf.get("relative_attention", False),
                             "bertjax's DeBERTa has relative attention only"),
      "position_biased_input": (hf.get("position_biased_input", True),
                                "absolute positions added to the input are not implemented"),
      "conv_kernel_size": (hf.get("conv_kernel_size", 0) > 0,
                           "the convolution after the first layer is not implemented"),
      "attention_head_size": (hf.get("attention_head_size", d // heads) != d // heads,
                              "heads narrower or wider than hidden_size / heads"),
      "embedding_size": (hf.get("embedding_size", d) != d,
                         "an embedding width other than hidden_size"),
  }
  for key, (bad, why) in refused.items():
    if bad:
      raise HFConversionError(f"{key}={hf.get(key)!r} is not supported: {why}")
  act = hf.get("hidden_act", "gelu")
  if act not in HF_ACT:
    raise HFConversionError(f"hidden_act={act!r} is not supported ({', '.join(HF_ACT)})")
  norm_rel = [x.strip() for x in str(hf.get("norm_rel_ebd", "none")).lower().split("|")]
  return ModelConfig(
      family="bert", vocab_size=hf["vocab_size"], hidden_size=d,
      num_layers=hf["num_hidden_layers"], num_heads=heads, mlp_dim=hf["intermediate_size"],
      max_positions=hf.get("max_position_embeddings", 512),
      type_vocab_size=hf.get("type_vocab_size", 0), norm_position="post",
      activation=HF_ACT[act], layer_norm_eps=hf.get("layer_norm_eps", 1e-7),
      hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
      attention_dropout=hf.get("attention_probs_dropout_prob", 0.1), pooler=False,
      architecture="deberta", position_embedding="relative", relative_attention_terms=_terms(hf),
      position_buckets=max(hf.get("position_buckets", -1), 0),
      max_relative_positions=max(hf.get("max_relative_positions", -1), 0),
      share_attention_key=bool(hf.get("share_att_key", False)),
      relative_embedding_norm="layer_norm" in norm_rel, **common)


def check_exportable(cfg: ModelConfig) -> None:
  """Raises unless a DeBERTa-layout config has DebertaV2ForMaskedLM's layout."""
  bert.check_unshared(cfg)
  wrong = [f"{k}={getattr(cfg, k)!r}" for k, v in _DEBERTA.items() if getattr(cfg, k) != v]
  if wrong:
    raise HFConversionError("a DeBERTa exports as DebertaV2ForMaskedLM, which needs "
                            + ", ".join(f"{k}={v!r}" for k, v in _DEBERTA.items())
                            + "; this config has " + ", ".join(wrong))


def config_dict(cfg: ModelConfig, dtype: str, act: str) -> dict[str, Any]:
  """DebertaV2ForMaskedLM's config.json with the lm_predictions head (legacy=False); 0 for
  position_buckets / max_relative_positions is transformers' -1. The pooler keys are those of
  a fine-tuned sequence classifier's ContextPooler (dense to the hidden size, GELU)."""
  return {
      "pooler_hidden_size": cfg.hidden_size, "pooler_hidden_act": "gelu",
      "pooler_dropout": cfg.hidden_dropout,
      "architectures": ["DebertaV2ForMaskedLM"], "model_type": "deberta-v2",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "embedding_size": cfg.embedding_width, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.mlp_dim,
      "hidden_act": act, "hidden_dropout_prob": cfg.hidden_dropout,
      "attention_probs_dropout_prob": cfg.attention_dropout,
      "max_position_embeddings": cfg.max_positions, "type_vocab_size": cfg.type_vocab_size,
      "initializer_range": cfg.initializer_range, "layer_norm_eps": cfg.layer_norm_eps,
      "relative_attention": True, "position_biased_input": False,
      "pos_att_type": cfg.relative_attention_terms.split("|"),
      "position_buckets": cfg.position_buckets or -1,
      "max_relative_positions": cfg.max_relative_positions or -1,
      "share_att_key": cfg.share_attention_key,
      "norm_rel_ebd": "layer_norm" if cfg.relative_embedding_norm else "none",
      "legacy": False, "pad_token_id": 0, "tie_word_embeddings": True, "torch_dtype": dtype}


def _entries(cfg: ModelConfig, prefix: str, head: str, tensors: Any) -> list[Entry]:
  if head in TASK_HEADS:
    return task_entries(cfg, head)
  return entries(cfg, prefix, tensors is not None and is_legacy(tensors))


def _config_dict(cfg: ModelConfig, request: ExportRequest) -> dict[str, Any]:
  """The MLM model's config.json, or a fine-tuned head's, or the bare encoder's."""
  config = {**config_dict(cfg, request.dtype, request.activation),
            **(request.generation_ids or {})}
  if request.head == "encoder":
    config["architectures"] = ["DebertaV2Model"]
  elif request.head in TASK_HEADS:
    config["architectures"] = [TASK_HEADS[request.head][0]]
    if request.head == "question_answering":
      config["num_labels"] = 2
    else:
      config.update(bert.label_keys(cfg, request.head, request.labels))
  return config


FORMATS = (HFFormat(
    model_type="deberta-v2", family="bert", prefix=PREFIX, entries=_entries,
    tied_copies=tied_copies, config_from_hf=config_from_hf, config_dict=_config_dict,
    claims=lambda cfg: cfg.family == "bert" and cfg.architecture == "deberta", priority=30,
    check_exportable=check_exportable,
    heads={"pretraining": "DebertaV2ForMaskedLM", "encoder": "DebertaV2Model",
           **{head: names[0] for head, names in TASK_HEADS.items()}},
    without_equivalent=lambda cfg, head: without_equivalent(cfg), ignored=ignored),)
