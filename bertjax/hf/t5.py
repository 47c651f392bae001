"""T5's mapping: parameter names of T5ForConditionalGeneration / T5Model / T5EncoderModel and
their config.json both ways.

transformers keeps q, k, v, o and every MLP kernel as Linear [out, in] (transposed here); bertjax
fuses the self-attention's q, k, v into one [D, 3, N, H] kernel and the cross-attention's k, v
into one [D, 2, N, H], and a gated MLP's wi_0, wi_1 into [D, 2, F]. The relative bias table sits
in the first layer of each stack there and beside the layers here. transformers 5 ties the LM
head to the token table in every T5 (1.1's untied head is not representable: its config's
tie_word_embeddings only says whether the decoder's output is scaled).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bertjax.hf.entries import Entry, HFConversionError, same, transposed
from bertjax.hf.formats import HFFormat
from bertjax.models import ModelConfig

PREFIX = ""


def _heads_in(name: tuple[str, ...], theirs: tuple[str, ...], d: int, n: int, h: int) -> Entry:
  """Our [D, T, N, H] kernel (T = len(theirs) fused projections; T = 0: [D, N, H]) <->
  Linear weights [N * H, D]."""
  if len(theirs) == 1:
    return Entry(name, theirs, lambda w: w.T.reshape(d, n, h), lambda x: (x.reshape(d, -1).T,))
  t = len(theirs)
  return Entry(name, theirs, lambda *ws: np.stack([w.T for w in ws], axis=1).reshape(d, t, n, h),
               lambda x: tuple(x.reshape(d, t, n * h)[:, i].T for i in range(t)))


def _heads_out(name: tuple[str, ...], theirs: str, d: int, n: int, h: int) -> Entry:
  """Our output kernel [N, H, D] <-> the Linear weight [D, N * H]."""
  return Entry(name, (theirs,), lambda w: w.T.reshape(n, h, d), lambda x: (x.reshape(n * h, d).T,))


def _mlp(cfg: ModelConfig, ours: tuple[str, ...], hf: str) -> list[Entry]:
  wi = (Entry(ours + ("wi", "kernel"), (f"{hf}wi_0.weight", f"{hf}wi_1.weight"),
              lambda a, b: np.stack([a.T, b.T], axis=1),
              lambda x: (x[:, 0].T, x[:, 1].T)) if cfg.mlp_gated
        else transposed(ours + ("wi", "kernel"), f"{hf}wi.weight"))
  return [wi, transposed(ours + ("wo", "kernel"), f"{hf}wo.weight")]


def entries(cfg: ModelConfig, prefix: str = PREFIX) -> list[Entry]:
  d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  entries = [same(("shared", "embedding"), f"{prefix}shared.weight")]
  for stack, depth in (("encoder", cfg.num_layers), ("decoder", cfg.decoder_depth)):
    entries += [
        same((stack, "relative_bias", "embedding"),
             f"{prefix}{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        same((stack, "final_norm", "scale"), f"{prefix}{stack}.final_layer_norm.weight")]
    for i in range(depth):
      ours = (stack, f"layers_{i}")
      hf = f"{prefix}{stack}.block.{i}.layer."
      attn = f"{hf}0.SelfAttention."
      entries += [
          _heads_in(ours + ("attention", "qkv", "kernel"),
                    tuple(f"{attn}{p}.weight" for p in "qkv"), d, n, h),
          _heads_out(ours + ("attention", "out", "kernel"), f"{attn}o.weight", d, n, h),
          same(ours + ("attention_norm", "scale"), f"{hf}0.layer_norm.weight")]
      mlp = 1
      if stack == "decoder":
        cross = f"{hf}1.EncDecAttention."
        entries += [
            _heads_in(ours + ("cross_attention", "query", "kernel"), (f"{cross}q.weight",),
                      d, n, h),
            _heads_in(ours + ("cross_attention", "kv", "kernel"),
                      (f"{cross}k.weight", f"{cross}v.weight"), d, n, h),
            _heads_out(ours + ("cross_attention", "out", "kernel"), f"{cross}o.weight", d, n, h),
            same(ours + ("cross_attention_norm", "scale"), f"{hf}1.layer_norm.weight")]
        mlp = 2
      entries += _mlp(cfg, ours + ("mlp",), f"{hf}{mlp}.DenseReluDense.")
      entries.append(same(ours + ("mlp_norm", "scale"), f"{hf}{mlp}.layer_norm.weight"))
  return entries


def tied_copies(prefix: str = PREFIX) -> dict[str, str]:
  """Checkpoint tensors that copy another (bertjax and transformers 5 tie them)."""
  return {f"{prefix}{name}": f"{prefix}shared.weight"
          for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                       "lm_head.weight")}


def _activation(feed_forward_proj: str) -> tuple[str, bool]:
  """(bertjax activation, gated) of a T5 config's feed_forward_proj, as transformers reads it
  ("gated-gelu" is the tanh form, for T5 1.1's checkpoints)."""
  parts = feed_forward_proj.split("-")
  gated = len(parts) == 2 and parts[0] == "gated"
  act = {"relu": "relu", "gelu": "gelu_tanh" if gated else "gelu", "gelu_new": "gelu_tanh",
         "silu": "silu"}.get(parts[-1])
  if act is None or len(parts) > 2 or (len(parts) == 2 and not gated):
    raise HFConversionError(f"T5 feed_forward_proj {feed_forward_proj!r} is not supported "
                            "(relu, gelu, gated-gelu, gated-relu, gated-silu)")
  return act, gated


def config_from_hf(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
  """A ModelConfig equivalent to a T5 config.json (`common`: the keys every family shares)."""
  act, gated = _activation(hf.get("feed_forward_proj", "relu"))
  d, n, h = hf.get("d_model", 512), hf.get("num_heads", 8), hf.get("d_kv", 64)
  dropout = hf.get("dropout_rate", 0.1)
  scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
  common = {**common, "initializer_range": hf.get("initializer_factor", 1.0)}
  layers = hf.get("num_layers", 6)
  return ModelConfig(
      family="t5", vocab_size=hf.get("vocab_size", 32128), hidden_size=d, num_layers=layers,
      decoder_layers=hf.get("num_decoder_layers") or layers, num_heads=n,
      head_size=h if h * n != d else 0, mlp_dim=hf.get("d_ff", 2048),
      max_positions=hf.get("n_positions", 512), type_vocab_size=0,
      norm_position="pre", activation=act, mlp_gated=gated,
      layer_norm_eps=hf.get("layer_norm_epsilon", 1e-6), hidden_dropout=dropout,
      attention_dropout=dropout, activation_dropout=dropout, attention_bias=False, mlp_bias=False,
      norm_bias=False,
      relative_attention_buckets=hf.get("relative_attention_num_buckets", 32),
      relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
      scale_decoder_outputs=bool(scale), **common)


def config_dict(cfg: ModelConfig, dtype: str, generation_ids: dict[str, int] | None = None
                ) -> dict[str, Any]:
  """T5ForConditionalGeneration's config.json (`generation_ids`: the special ids of a bertjax
  T5-style tokenizer, the same as T5's: pad 0 = the decoder's start, eos 1)."""
  act = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu", "silu": "silu"}[cfg.activation]
  if cfg.activation == "gelu" and cfg.mlp_gated:
    raise HFConversionError("transformers' T5 reads gated-gelu as the tanh form: a gated T5 "
                            "exports with model.activation=gelu_tanh")
  if cfg.activation == "gelu_tanh" and not cfg.mlp_gated:
    raise HFConversionError("transformers' T5 reads an ungated gelu as the exact form: an "
                            "ungated T5 exports with model.activation=gelu or relu")
  if not cfg.hidden_dropout == cfg.attention_dropout == cfg.activation_dropout:
    raise HFConversionError("transformers' T5 has one dropout rate: model.hidden_dropout, "
                            "model.attention_dropout and model.activation_dropout must be equal")
  return {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
          "vocab_size": cfg.vocab_size, "d_model": cfg.hidden_size, "d_kv": cfg.head_dim,
          "d_ff": cfg.mlp_dim, "num_layers": cfg.num_layers,
          "num_decoder_layers": cfg.decoder_depth, "num_heads": cfg.num_heads,
          "relative_attention_num_buckets": cfg.relative_attention_buckets,
          "relative_attention_max_distance": cfg.relative_attention_max_distance,
          "dropout_rate": cfg.hidden_dropout, "layer_norm_epsilon": cfg.layer_norm_eps,
          "initializer_factor": cfg.initializer_range,
          "feed_forward_proj": f"gated-{act}" if cfg.mlp_gated else act,
          # transformers 5 reads the decoder's output scaling from this key.
          "tie_word_embeddings": cfg.scale_decoder_outputs,
          "is_encoder_decoder": True, "pad_token_id": 0, "eos_token_id": 1,
          "decoder_start_token_id": 0, "n_positions": cfg.max_positions, "torch_dtype": dtype,
          **(generation_ids or {})}


FORMATS = (HFFormat(
    model_type="t5", family="t5", prefix=PREFIX,
    entries=lambda cfg, prefix, head, tensors: entries(cfg, prefix),
    tied_copies=tied_copies, config_from_hf=config_from_hf,
    config_dict=lambda cfg, r: config_dict(cfg, r.dtype, r.generation_ids),
    claims=lambda cfg: cfg.family == "t5", heads={"pretraining": "T5ForConditionalGeneration"}),)
