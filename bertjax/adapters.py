"""Parameter-efficient tuning: which parameters train, saving and loading only those, counting
them, folding LoRA into the base weights, and exporting a LoRA adapter for `peft`.

The additions themselves are model options (bertjax/models/config.py: `lora_rank`,
`adapter_size`, `prefix_length`) built by bertjax/models/layers.py; `optimizer.freeze="base"`
(bertjax/optim.py) trains only them and the heads outside the encoder, as peft trains the
adapter and its `modules_to_save`. `bertjax.optim.is_added` is the one test of whether a
parameter is an addition; everything here goes through it.

Why the pieces:
- `trainable_params` / `combine`: a fine-tuned checkpoint need hold only what training changed
  (a few percent of the model) and name its base; loading puts the two back together.
- `report`: trainable against total, and per LoRA target what the update costs against the
  projection it updates (the numbers people quote for LoRA).
- `merge_lora`: W + (alpha/r)·A·B folded into each kernel gives a plain model of the base
  architecture, which `bertjax.hf.export_hf` exports unchanged.
- `export_peft`: the unmerged adapter in peft's own format (adapter_config.json +
  adapter_model.safetensors, with peft's tensor names), loadable by
  `peft.PeftModel.from_pretrained` on the base model exported by `export_hf`.

No torch, transformers or peft import: the files are written with safetensors' numpy API.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from etils import epath
from flax import traverse_util
from safetensors.numpy import save as save_safetensors

from bertjax import hf, optim, paths
from bertjax.models import ModelConfig, stack_layers, unstack_layers
from bertjax.models.layers import LORA_SITES, lora_param_names

Flat = dict[tuple[str, ...], Any]

is_added = optim.is_added

# The model options that add parameters, and what each is when off.
_ADDITIONS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "adapter_size",
              "prefix_length")

# Hugging Face module (inside one layer) each LoRA target updates.
_HF_BERT_MODULES = {"query": "attention.self.query", "key": "attention.self.key",
                    "value": "attention.self.value", "out": "attention.output.dense",
                    "wi": "intermediate.dense", "wo": "output.dense"}
_HF_GPT_MODULES = {"qkv": "attn.c_attn", "out": "attn.c_proj", "wi": "mlp.c_fc",
                   "wo": "mlp.c_proj"}
# peft's task type for each export head (None: the bare PeftModel; peft has no MLM task), and
# the head module it must load from the adapter (modules_to_save).
_PEFT_TASKS = {"pretraining": None, "sequence_classification": "SEQ_CLS",
               "token_classification": "TOKEN_CLS", "question_answering": "QUESTION_ANS"}
_HEAD_MODULES = {"sequence_classification": "classifier", "token_classification": "classifier",
                 "question_answering": "qa_outputs"}


def _flat(params: Any) -> Flat:
  return traverse_util.flatten_dict(nn.meta.unbox(params))


def _defaults() -> dict[str, Any]:
  return {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in _ADDITIONS}


def has_additions(params: Any) -> bool:
  """Whether `params` holds any LoRA, adapter or prefix parameter."""
  return any(is_added(key) for key in _flat(params))


def without_additions(params: Any) -> Any:
  """The base model's parameters: `params` with every addition left out."""
  return traverse_util.unflatten_dict({k: v for k, v in _flat(params).items()
                                       if not is_added(k)})


def base_model_config(config: ModelConfig) -> ModelConfig:
  """`config` with every parameter-efficient option off: the base model's config."""
  return config.replace(**_defaults())


# --- saving and loading only what trains ---------------------------------------------------

def trainable_params(params: Any, freeze: str = "base") -> Any:
  """The subtree of parameters `optimizer.freeze=freeze` trains (with "base": the additions
  and the heads outside the encoder). A scanned leaf with only some rows frozen (bottom:K) is
  kept whole. Works on arrays and on abstract shapes alike."""
  params = nn.meta.unbox(params)
  flags = _flat(optim.frozen_rows(params, freeze))
  return traverse_util.unflatten_dict({k: v for k, v in _flat(params).items()
                                       if flags[k] is not True})


def combine(base_params: Any, trainable: Any) -> Any:
  """`base_params` with `trainable` (from `trainable_params`) put in: its leaves replace the
  base's of the same path, and the additions the base lacks are added. A leaf whose shape
  differs from the base's is a checkpoint of another model: ValueError naming it."""
  out = _flat(base_params)
  for key, value in _flat(trainable).items():
    if key in out and np.shape(out[key]) != np.shape(value):
      raise ValueError(f"parameter {'/'.join(key)} has shape {np.shape(value)} in the trained "
                       f"parameters but {np.shape(out[key])} in the base model")
    out[key] = value
  return traverse_util.unflatten_dict(out)


# --- counts --------------------------------------------------------------------------------

def _size(leaf: Any) -> int:
  return int(math.prod(np.shape(leaf)))


def report(params: Any, config: ModelConfig, freeze: str = "base") -> dict[str, Any]:
  """Parameter counts of a model with additions, from arrays or abstract shapes
  (`jax.eval_shape`: nothing allocated).

  Returns total, trainable, percent (trainable / total, in %), freeze, the trainable part by
  group (additions, heads, encoder), and per addition: for every LoRA target its [in, out]
  shape, rank, parameters per layer and their percentage of the projection's weights; the
  adapters' and prefixes' parameters per layer."""
  params = nn.meta.unbox(params)
  flat = _flat(params)
  flags = _flat(optim.frozen_rows(params, freeze))
  groups = {"additions": 0, "heads": 0, "encoder": 0}
  total = trainable = 0
  for key, leaf in flat.items():
    size, flag = _size(leaf), flags[key]
    total += size
    if flag is True:
      continue
    trained = size if flag is False else round(size * (1 - float(np.mean(flag))))
    trainable += trained
    group = ("additions" if is_added(key) else
             "heads" if optim.encoder_path(key) is None else "encoder")
    groups[group] += trained
  layers = config.num_layers
  lora = []
  for target in config.lora_modules:
    site = LORA_SITES[target][0]
    a_name, b_name = lora_param_names(target)
    a = sum(_size(v) for k, v in flat.items() if k[-3:] == site + (a_name,))
    b = sum(_size(v) for k, v in flat.items() if k[-3:] == site + (b_name,))
    r = config.lora_rank
    fan_in, fan_out = a // (r * layers), b // (r * layers)
    per_layer = (a + b) // layers
    lora.append({"target": target, "shape": (fan_in, fan_out), "rank": r,
                 "per_layer": per_layer, "layers": layers, "total": a + b,
                 "base_per_layer": fan_in * fan_out,
                 "percent_of_base": 100.0 * per_layer / (fan_in * fan_out)})
  adapters = sum(_size(v) for k, v in flat.items() if any(n.startswith("adapter_") for n in k))
  prefixes = sum(_size(v) for k, v in flat.items() if k[-1].startswith("prefix_"))
  return {"total": total, "trainable": trainable,
          "percent": 100.0 * trainable / total if total else 0.0, "freeze": freeze,
          "groups": groups, "lora": lora,
          "adapters": ({"size": config.adapter_size, "per_layer": adapters // layers,
                        "total": adapters} if adapters else None),
          "prefix": ({"length": config.prefix_length, "per_layer": prefixes // layers,
                      "total": prefixes} if prefixes else None)}


def format_report(counts: dict[str, Any]) -> str:
  """`report`'s dict as the lines `bertjax info` prints."""
  lines = [f"trainable      {counts['trainable']:,d} of {counts['total']:,d} "
           f"({counts['percent']:.2f}%) with optimizer.freeze={counts['freeze']}"]
  groups = counts["groups"]
  lines.append(f"  additions {groups['additions']:,d}, heads {groups['heads']:,d}, "
               f"encoder {groups['encoder']:,d}")
  for entry in counts["lora"]:
    fan_in, fan_out = entry["shape"]
    lines.append(f"  lora {entry['target']:6s} {fan_in}x{fan_out}, rank {entry['rank']}: "
                 f"{entry['per_layer']:,d} per layer, {entry['percent_of_base']:.1f}% of "
                 f"{entry['base_per_layer']:,d} ({entry['layers']} layers: "
                 f"{entry['total']:,d})")
  if counts["adapters"]:
    a = counts["adapters"]
    lines.append(f"  adapters    size {a['size']}: {a['per_layer']:,d} per layer "
                 f"({a['total']:,d})")
  if counts["prefix"]:
    p = counts["prefix"]
    lines.append(f"  prefix      length {p['length']}: {p['per_layer']:,d} per layer "
                 f"({p['total']:,d})")
  return "\n".join(lines)


# --- LoRA merged into the kernels ----------------------------------------------------------

def _layer_prefix(config: ModelConfig) -> tuple[str, ...]:
  return ("bert", "encoder") if config.family == "bert" else ("decoder",)


def _lora_delta(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
  """scale · A B for A [*in, r], B [r, *out] (one layer): [*in, *out] in float32."""
  return scale * np.tensordot(np.asarray(a, np.float32), np.asarray(b, np.float32), axes=1)


def merge_lora(params: Any, config: ModelConfig) -> tuple[Any, ModelConfig]:
  """Every LoRA update folded into its kernel, W + (alpha/r)·A·B, the LoRA parameters removed,
  and the config with LoRA off; the layout (scanned or not) is kept. Adapters and prefixes,
  if any, stay (they have no plain-model equivalent, and `export_hf` refuses them by name).
  Without LoRA: the inputs unchanged."""
  if not config.lora_rank:
    return params, config
  flat = unstack_layers({k: np.asarray(jax.device_get(v)) for k, v in _flat(params).items()},
                        config)
  prefix = _layer_prefix(config)
  for i in range(config.num_layers):
    layer = prefix + (f"layers_{i}",)
    for target in config.lora_modules:
      site, index = LORA_SITES[target]
      a_name, b_name = lora_param_names(target)
      try:
        a, b = flat.pop(layer + site + (a_name,)), flat.pop(layer + site + (b_name,))
      except KeyError as e:
        raise ValueError(f"LoRA parameter {'/'.join(e.args[0])} is missing: the parameters "
                         f"do not fit model.lora_targets={config.lora_targets!r}") from None
      kernel_key = layer + site + ("kernel",)
      kernel = flat[kernel_key]
      merged = np.array(kernel, np.float32)
      delta = _lora_delta(a, b, config.lora_scale)
      if index is None:
        merged += delta
      else:
        merged[(slice(None),) * (a.ndim - 1) + (index,)] += delta
      flat[kernel_key] = merged.astype(kernel.dtype)
  left = [k for k in flat if k[-1].startswith("lora_")]
  if left:
    raise ValueError(f"LoRA parameter {'/'.join(left[0])} is not one of "
                     f"model.lora_targets={config.lora_targets!r}")
  off = _defaults()
  merged_config = config.replace(**{k: off[k] for k in ("lora_rank", "lora_alpha",
                                                        "lora_dropout", "lora_targets")})
  return traverse_util.unflatten_dict(stack_layers(flat, config)), merged_config


# --- peft export ---------------------------------------------------------------------------

def _target_modules(config: ModelConfig) -> list[str] | str:
  """peft's `target_modules`: module-name suffixes, or a regular expression where a suffix
  would match too much (BERT's `output.dense` also ends `attention.output.dense`)."""
  targets = config.lora_modules
  if config.family == "gpt":
    return [_HF_GPT_MODULES[t] for t in targets]
  names = [_HF_BERT_MODULES[t] for t in targets]
  if "wo" in targets and "out" not in targets:
    return r".*\.layer\.\d+\.(" + "|".join(n.replace(".", r"\.") for n in names) + ")"
  return names


def _check_peft_export(config: ModelConfig, head: str) -> str:
  if not config.lora_rank:
    raise ValueError("export_peft needs a LoRA model (model.lora_rank > 0)")
  if config.adapter_size or config.prefix_length:
    raise ValueError("export_peft writes LoRA adapters only; this model also has "
                     + " and ".join(n for n, on in (("bottleneck adapters", config.adapter_size),
                                                    ("prefixes", config.prefix_length)) if on))
  if head not in _PEFT_TASKS:
    raise ValueError(f"head must be one of {', '.join(_PEFT_TASKS)}, got {head!r}")
  model_type = hf.hf_config_dict(base_model_config(config))["model_type"]
  if model_type not in ("bert", "gpt2", "openai-gpt"):
    raise ValueError(f"export_peft knows BERT and GPT-2 module names, not {model_type}'s; "
                     "export the merged model with --format hf")
  if model_type != "bert" and head != "pretraining":
    raise ValueError(f"head={head!r} is for BERT; this is a {config.family} model")
  return model_type


def peft_config_dict(config: ModelConfig, base_model_name_or_path: str,
                     head: str = "pretraining") -> dict[str, Any]:
  """adapter_config.json: a peft LoraConfig (alpha/r scaling, no rsLoRA or DoRA)."""
  model_type = _check_peft_export(config, head)
  alpha = config.lora_alpha
  task = "CAUSAL_LM" if model_type != "bert" else _PEFT_TASKS[head]
  return {"peft_type": "LORA", "task_type": task, "base_model_name_or_path":
          base_model_name_or_path, "r": config.lora_rank,
          "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
          "lora_dropout": config.lora_dropout, "target_modules": _target_modules(config),
          # GPT-2's Conv1D stores [in, out]: peft transposes its update when merging.
          "fan_in_fan_out": model_type != "bert", "bias": "none",
          "modules_to_save": [_HEAD_MODULES[head]] if head in _HEAD_MODULES else None,
          "init_lora_weights": True, "use_rslora": False, "use_dora": False,
          "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
          "alpha_pattern": {}, "inference_mode": True, "revision": None}


def peft_state_dict(params: Any, config: ModelConfig,
                    head: str = "pretraining") -> dict[str, np.ndarray]:
  """The adapter's tensors under peft's names: `base_model.model.<module>.lora_A.weight`
  [r, in] and `lora_B.weight` [out, r] (nn.Linear layout, also for GPT-2's Conv1D), plus the
  head module's weight and bias for `modules_to_save`."""
  model_type = _check_peft_export(config, head)
  flat = unstack_layers({k: np.asarray(jax.device_get(v), np.float32)
                         for k, v in _flat(params).items()}, config)
  prefix = _layer_prefix(config)
  r = config.lora_rank
  tensors: dict[str, np.ndarray] = {}
  for i in range(config.num_layers):
    layer = prefix + (f"layers_{i}",)
    for target in config.lora_modules:
      site = LORA_SITES[target][0]
      a_name, b_name = lora_param_names(target)
      a, b = flat[layer + site + (a_name,)], flat[layer + site + (b_name,)]
      if model_type == "bert":
        module = f"bert.encoder.layer.{i}.{_HF_BERT_MODULES[target]}"
      else:
        module = f"transformer.h.{i}.{_HF_GPT_MODULES[target]}"
      # The output axes flatten in Hugging Face's order ([3, N, H] is c_attn's q|k|v, [N, H]
      # a head-major feature axis), as in bertjax.hf's kernel conversion.
      tensors[f"base_model.model.{module}.lora_A.weight"] = a.reshape(-1, r).T
      tensors[f"base_model.model.{module}.lora_B.weight"] = b.reshape(r, -1).T
  if head in _HEAD_MODULES:
    name = _HEAD_MODULES[head]
    if (name, "kernel") not in flat:
      raise ValueError(f"head={head!r} but the parameters have no {name!r} head")
    tensors[f"base_model.model.{name}.weight"] = flat[(name, "kernel")].T
    tensors[f"base_model.model.{name}.bias"] = flat[(name, "bias")]
  return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def export_peft(params: Any, config: ModelConfig, out_dir: paths.PathLike,
                base_model_name_or_path: str, head: str = "pretraining") -> epath.Path:
  """Writes the unmerged LoRA adapter as peft saves one: adapter_config.json and
  adapter_model.safetensors, for `peft.PeftModel.from_pretrained(base, out_dir)` where `base`
  is the model `bertjax.hf.export_hf` writes from the base parameters (`without_additions`,
  `base_model_config`) with the same `head`.

  `head`: as export_hf's. A fine-tuning head (classifier, qa_outputs) goes in as peft's
  `modules_to_save`; BERT's pre-training heads do not (peft would copy the tied decoder):
  export the base with the heads the adapter was trained with."""
  out = paths.path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  config_json = peft_config_dict(config, base_model_name_or_path, head)
  tensors = peft_state_dict(params, config, head)
  (out / "adapter_model.safetensors").write_bytes(
      save_safetensors(tensors, metadata={"format": "pt"}))
  (out / "adapter_config.json").write_text(json.dumps(config_json, indent=2) + "\n")
  return out
