"""GPT's mapping: parameter names of GPT-2 (GPT2LMHeadModel / GPT2Model) and GPT-1
(OpenAIGPTLMHeadModel / OpenAIGPTModel), and their config.json both ways.

GPT's Conv1D stores [in, out] (no transpose); bertjax fuses Q, K, V into one [D, 3, N, H]
kernel and keeps heads as their own axis.
"""

from __future__ import annotations

from typing import Any

from bertjax.hf.entries import HF_ACT, Entry, HFConversionError, check_classic, norm, same
from bertjax.hf.formats import HFFormat, PeftLayout
from bertjax.models import ModelConfig

# Where the Hugging Face models keep the decoder under the LM head: its tensors' name prefix.
PREFIX = "transformer."


def entries(cfg: ModelConfig, prefix: str, gpt1: bool) -> list[Entry]:
  d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
  wte, wpe = ("tokens_embed", "positions_embed") if gpt1 else ("wte", "wpe")
  entries = [same(("wte", "embedding"), f"{prefix}{wte}.weight"),
             same(("wpe", "embedding"), f"{prefix}{wpe}.weight")]
  if not gpt1:
    entries += norm(("final_norm",), f"{prefix}ln_f")
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
        same(ours + ("attention", "out", "bias"), f"{hf}attn.c_proj.bias"),
        *norm(ours + ("attention_norm",), f"{hf}ln_1"),
        same(ours + ("mlp", "wi", "kernel"), f"{hf}mlp.c_fc.weight"),
        same(ours + ("mlp", "wi", "bias"), f"{hf}mlp.c_fc.bias"),
        same(ours + ("mlp", "wo", "kernel"), f"{hf}mlp.c_proj.weight"),
        same(ours + ("mlp", "wo", "bias"), f"{hf}mlp.c_proj.bias"),
        *norm(ours + ("mlp_norm",), f"{hf}ln_2"),
    ]
  return entries


def tied_copies(prefix: str, gpt1: bool) -> dict[str, str]:
  """Checkpoint tensors that copy another (bertjax ties them): copy -> original."""
  return {"lm_head.weight": f"{prefix}{'tokens_embed' if gpt1 else 'wte'}.weight"}


def config_from_hf(hf: dict[str, Any], common: dict[str, Any], gpt1: bool) -> ModelConfig:
  """A ModelConfig equivalent to a GPT-2 (or with `gpt1`, an OpenAIGPT) config.json
  (`common`: the keys every family shares)."""
  act = hf.get("afn" if gpt1 else "activation_function", "gelu" if gpt1 else "gelu_new")
  if gpt1 and act == "gelu":
    act = "gelu_new"  # OpenAIGPT's "gelu" is the tanh approximation (its ACT_FNS table)
  if act not in HF_ACT:
    raise HFConversionError(f"activation {act!r} is not supported ({', '.join(HF_ACT)})")
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
      activation=HF_ACT[act], layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
      hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
      scale_residual_init=not gpt1, **common)


def model_type(cfg: ModelConfig) -> str:
  """The Hugging Face model type a GPT config exports as: gpt2 or openai-gpt."""
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


def config_dict(cfg: ModelConfig, dtype: str, act: str, generation_ids: dict[str, int] | None,
                gpt1: bool) -> dict[str, Any]:
  """GPT2LMHeadModel's (or with `gpt1`, OpenAIGPTLMHeadModel's) config.json (`act`: the Hugging
  Face activation name; `generation_ids`: see hf_config_dict)."""
  common = {"vocab_size": cfg.vocab_size, "n_positions": cfg.max_positions,
            "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout, "layer_norm_epsilon": cfg.layer_norm_eps,
            "initializer_range": cfg.initializer_range, "tie_word_embeddings": True,
            "torch_dtype": dtype}
  if gpt1:
    common.update(generation_ids or {})
    if cfg.mlp_dim != 4 * cfg.hidden_size:
      raise HFConversionError("OpenAIGPT requires mlp_dim == 4 * hidden_size")
    # OpenAIGPT's afn "gelu" is the tanh approximation.
    return {"architectures": ["OpenAIGPTLMHeadModel"], "model_type": "openai-gpt",
            "afn": "gelu", **common}
  return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_inner": cfg.mlp_dim,
          "activation_function": act, **(generation_ids or _default_generation_ids(cfg)),
          **common}


def _check_exportable(cfg: ModelConfig) -> None:
  check_classic(cfg, "GPT-2")
  model_type(cfg)


_PEFT = PeftLayout(layer=PREFIX + "h.{}.",
                   modules={"qkv": "attn.c_attn", "out": "attn.c_proj", "wi": "mlp.c_fc",
                            "wo": "mlp.c_proj"}, fan_in_fan_out=True, task_heads=False)


def _format(model_type: str, gpt1: bool, norm_position: str, hf_class: str) -> HFFormat:
  """GPT-2's format (pre-LN) or GPT-1's (post-LN): one mapping, told apart by `gpt1`."""
  return HFFormat(
      model_type=model_type, family="gpt", prefix=PREFIX,
      entries=lambda cfg, prefix, head, tensors: entries(cfg, prefix, gpt1=gpt1),
      tied_copies=lambda prefix: tied_copies(prefix, gpt1=gpt1),
      config_from_hf=lambda hf, common: config_from_hf(hf, common, gpt1=gpt1),
      config_dict=lambda cfg, r: config_dict(cfg, r.dtype, r.activation, r.generation_ids,
                                             gpt1=gpt1),
      claims=lambda cfg: cfg.family == "gpt" and cfg.norm_position == norm_position,
      check_exportable=_check_exportable, heads={"pretraining": hf_class}, peft=_PEFT)


FORMATS = (_format("gpt2", False, "pre", "GPT2LMHeadModel"),
           _format("openai-gpt", True, "post", "OpenAIGPTLMHeadModel"))
