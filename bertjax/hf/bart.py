"""BART's mapping: parameter names of BartForConditionalGeneration / BartModel and their
config.json both ways.

transformers keeps q_proj, k_proj, v_proj separately (fused here: [D, 3, N, H] in self-attention,
k and v [D, 2, N, H] in cross-attention), Linear weights [out, in] (transposed here), and a
`final_logits_bias` buffer of zeros that nothing trains: written as zeros on export, and on import
required to be zeros (a checkpoint with another bias does not fit a model without one).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bertjax.hf.entries import HF_ACT, Entry, HFConversionError, fused_qkv, norm, same, transposed
from bertjax.hf.formats import HFFormat
from bertjax.models import ModelConfig

PREFIX = "model."
FINAL_LOGITS_BIAS = "final_logits_bias"


def _fused_kv(ours: tuple[str, ...], theirs: str, d: int, n: int, h: int) -> list[Entry]:
  """Our cross-attention kv kernel [D, 2, N, H] and bias [2, N, H] <-> k_proj and v_proj."""
  names = (f"{theirs}k_proj", f"{theirs}v_proj")
  return [
      Entry(ours + ("kernel",), tuple(f"{t}.weight" for t in names),
            lambda k, v: np.stack([k.T, v.T], axis=1).reshape(d, 2, n, h),
            lambda x: tuple(x.reshape(d, 2, d)[:, t].T for t in range(2))),
      Entry(ours + ("bias",), tuple(f"{t}.bias" for t in names),
            lambda k, v: np.stack([k, v]).reshape(2, n, h), lambda x: tuple(x.reshape(2, d))),
  ]


def _attention(ours: tuple[str, ...], theirs: str, d: int, n: int, h: int,
               cross: bool) -> list[Entry]:
  if cross:
    inputs = [Entry(ours + ("query", "kernel"), (f"{theirs}q_proj.weight",),
                    lambda w: w.T.reshape(d, n, h), lambda x: (x.reshape(d, d).T,)),
              Entry(ours + ("query", "bias"), (f"{theirs}q_proj.bias",),
                    lambda b: b.reshape(n, h), lambda x: (x.reshape(d),)),
              *_fused_kv(ours + ("kv",), theirs, d, n, h)]
  else:
    inputs = fused_qkv(ours + ("qkv",), tuple(f"{theirs}{p}_proj" for p in "qkv"), d, n, h)
  return inputs + [
      Entry(ours + ("out", "kernel"), (f"{theirs}out_proj.weight",),
            lambda w: w.T.reshape(n, h, d), lambda x: (x.reshape(d, d).T,)),
      same(ours + ("out", "bias"), f"{theirs}out_proj.bias")]


def entries(cfg: ModelConfig, prefix: str = PREFIX) -> list[Entry]:
  d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  entries = [same(("shared", "embedding"), f"{prefix}shared.weight")]
  for stack, depth in (("encoder", cfg.num_layers), ("decoder", cfg.decoder_depth)):
    entries += [same((stack, "positions", "embedding"), f"{prefix}{stack}.embed_positions.weight"),
                *norm((stack, "embedding_norm"), f"{prefix}{stack}.layernorm_embedding")]
    for i in range(depth):
      ours = (stack, f"layers_{i}")
      hf = f"{prefix}{stack}.layers.{i}."
      entries += _attention(ours + ("attention",), f"{hf}self_attn.", d, n, h, cross=False)
      entries += norm(ours + ("attention_norm",), f"{hf}self_attn_layer_norm")
      if stack == "decoder":
        entries += _attention(ours + ("cross_attention",), f"{hf}encoder_attn.", d, n, h,
                              cross=True)
        entries += norm(ours + ("cross_attention_norm",), f"{hf}encoder_attn_layer_norm")
      entries += [transposed(ours + ("mlp", "wi", "kernel"), f"{hf}fc1.weight"),
                  same(ours + ("mlp", "wi", "bias"), f"{hf}fc1.bias"),
                  transposed(ours + ("mlp", "wo", "kernel"), f"{hf}fc2.weight"),
                  same(ours + ("mlp", "wo", "bias"), f"{hf}fc2.bias"),
                  *norm(ours + ("mlp_norm",), f"{hf}final_layer_norm")]
  return entries


def tied_copies(prefix: str = PREFIX) -> dict[str, str]:
  """Checkpoint tensors that copy another (bertjax ties them)."""
  return {f"{prefix}{name}": f"{prefix}shared.weight"
          for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")} | {
              "lm_head.weight": f"{prefix}shared.weight"}


def check_final_logits_bias(tensors: dict[str, np.ndarray]) -> None:
  """The buffer must be zeros: bertjax's BART has no output bias."""
  bias = tensors.get(FINAL_LOGITS_BIAS)
  if bias is not None and np.any(bias != 0):
    raise HFConversionError(f"tensor {FINAL_LOGITS_BIAS} is not zero: bertjax's BART has no "
                            "output bias (transformers never trains it)")


def extra_tensors(cfg: ModelConfig) -> dict[str, np.ndarray]:
  """What an export adds beyond the parameters: the zero buffer transformers' class declares."""
  return {FINAL_LOGITS_BIAS: np.zeros((1, cfg.vocab_size), np.float32)}


def config_from_hf(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
  """A ModelConfig equivalent to a BART config.json (`common`: the keys every family shares)."""
  for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"),
                   ("encoder_ffn_dim", "decoder_ffn_dim")):
    if hf.get(enc, 16) != hf.get(dec, 16):
      raise HFConversionError(f"BART with {enc}={hf.get(enc)} and {dec}={hf.get(dec)}: bertjax's "
                              "encoder and decoder layers have one shape")
  act = hf.get("activation_function", "gelu")
  if act not in HF_ACT:
    raise HFConversionError(f"activation {act!r} is not supported ({', '.join(HF_ACT)})")
  if hf.get("add_final_layer_norm") or hf.get("normalize_before"):
    raise HFConversionError("pre-LN BART variants (mBART's normalize_before, "
                            "add_final_layer_norm) are not supported")
  common = {**common, "initializer_range": hf.get("init_std", 0.02)}
  return ModelConfig(
      family="bart", vocab_size=hf.get("vocab_size", 50265), hidden_size=hf.get("d_model", 1024),
      num_layers=hf.get("encoder_layers", 12), decoder_layers=hf.get("decoder_layers", 12),
      num_heads=hf.get("encoder_attention_heads", 16), mlp_dim=hf.get("encoder_ffn_dim", 4096),
      max_positions=hf.get("max_position_embeddings", 1024), type_vocab_size=0,
      norm_position="post", activation=HF_ACT[act], layer_norm_eps=1e-5,
      hidden_dropout=hf.get("dropout", 0.1), attention_dropout=hf.get("attention_dropout", 0.0),
      activation_dropout=hf.get("activation_dropout", 0.0),
      scale_embeddings=bool(hf.get("scale_embedding", False)), **common)


def config_dict(cfg: ModelConfig, dtype: str, act: str) -> dict[str, Any]:
  """BartForConditionalGeneration's config.json (`act`: the Hugging Face activation name)."""
  if cfg.layer_norm_eps != 1e-5 or cfg.norm_position != "post" or cfg.head_size not in (
      0, cfg.hidden_size // cfg.num_heads):
    raise HFConversionError("transformers' BART is post-LN with LayerNorm epsilon 1e-5 and "
                            "heads of hidden_size / num_heads")
  return {"architectures": ["BartForConditionalGeneration"], "model_type": "bart",
          "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_positions,
          "d_model": cfg.hidden_size, "encoder_layers": cfg.num_layers,
          "decoder_layers": cfg.decoder_depth, "encoder_attention_heads": cfg.num_heads,
          "decoder_attention_heads": cfg.num_heads, "encoder_ffn_dim": cfg.mlp_dim,
          "decoder_ffn_dim": cfg.mlp_dim, "activation_function": act,
          "dropout": cfg.hidden_dropout, "attention_dropout": cfg.attention_dropout,
          "activation_dropout": cfg.activation_dropout, "init_std": cfg.initializer_range,
          "scale_embedding": cfg.scale_embeddings, "tie_word_embeddings": True,
          "is_encoder_decoder": True, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
          "decoder_start_token_id": 2, "forced_eos_token_id": None, "torch_dtype": dtype}


FORMATS = (HFFormat(
    model_type="bart", family="bart", prefix=PREFIX,
    entries=lambda cfg, prefix, head, tensors: entries(cfg, prefix),
    tied_copies=tied_copies, config_from_hf=config_from_hf,
    config_dict=lambda cfg, r: {**config_dict(cfg, r.dtype, r.activation),
                                **(r.generation_ids or {})},
    claims=lambda cfg: cfg.family == "bart",
    heads={"pretraining": "BartForConditionalGeneration"},
    ignored=lambda name: name == FINAL_LOGITS_BIAS, check_tensors=check_final_logits_bias,
    extra_tensors=extra_tensors),)
