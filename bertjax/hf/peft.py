"""The unmerged LoRA adapter in peft's own format (adapter_config.json +
adapter_model.safetensors, with peft's tensor names), loadable by
`peft.PeftModel.from_pretrained` on the base model that `export_hf` writes.

No torch, transformers or peft import: the files are written with safetensors' numpy API.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jax
import numpy as np
from etils import epath
from safetensors.numpy import save as save_safetensors

from bertjax import paths
from bertjax.hf.convert import format_for
from bertjax.hf.formats import PeftLayout
from bertjax.models.config import ModelConfig
from bertjax.models.lora import LORA_SITES, lora_param_names
from bertjax.models.params import layer_prefix, unstack_layers
from bertjax.models.peft import base_model_config, flat_params

# peft's task type for each export head (None: the bare PeftModel; peft has no MLM task), and
# the head module it must load from the adapter (modules_to_save).
_PEFT_TASKS = {"pretraining": None, "sequence_classification": "SEQ_CLS",
               "token_classification": "TOKEN_CLS", "question_answering": "QUESTION_ANS"}
_HEAD_MODULES = {"sequence_classification": "classifier", "token_classification": "classifier",
                 "question_answering": "qa_outputs"}


def _target_modules(config: ModelConfig, layout: PeftLayout) -> list[str] | str:
  """peft's `target_modules`: module-name suffixes, or a regular expression where a suffix
  would match a module not targeted too (BERT's `output.dense` also ends
  `attention.output.dense`)."""
  names = [layout.modules[t] for t in config.lora_modules]
  others = [m for t, m in layout.modules.items() if t not in config.lora_modules]
  if any(other.endswith("." + name) for name in names for other in others):
    layer = re.escape(layout.layer).replace(re.escape("{}"), r"\d+")
    return ".*" + layer + "(" + "|".join(re.escape(n) for n in names) + ")"
  return names


def _check_peft_export(config: ModelConfig, head: str) -> PeftLayout:
  if not config.lora_rank:
    raise ValueError("export_peft needs a LoRA model (model.lora_rank > 0)")
  if config.adapter_size or config.prefix_length:
    raise ValueError("export_peft writes LoRA adapters only; this model also has "
                     + " and ".join(n for n, on in (("bottleneck adapters", config.adapter_size),
                                                    ("prefixes", config.prefix_length)) if on))
  if head not in _PEFT_TASKS:
    raise ValueError(f"head must be one of {', '.join(_PEFT_TASKS)}, got {head!r}")
  fmt = format_for(base_model_config(config))
  if fmt.peft is None:
    raise ValueError(f"export_peft does not know {fmt.model_type}'s module names; export the "
                     "merged model with --format hf")
  if not fmt.peft.task_heads and head != "pretraining":
    raise ValueError(f"head={head!r} is for an encoder; this is a {config.family} model")
  return fmt.peft


def peft_config_dict(config: ModelConfig, base_model_name_or_path: str,
                     head: str = "pretraining") -> dict[str, Any]:
  """adapter_config.json: a peft LoraConfig (alpha/r scaling, no rsLoRA or DoRA)."""
  layout = _check_peft_export(config, head)
  alpha = config.lora_alpha
  task = _PEFT_TASKS[head] if layout.task_heads else "CAUSAL_LM"
  return {"peft_type": "LORA", "task_type": task, "base_model_name_or_path":
          base_model_name_or_path, "r": config.lora_rank,
          "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
          "lora_dropout": config.lora_dropout, "target_modules": _target_modules(config, layout),
          # GPT-2's Conv1D stores [in, out]: peft transposes its update when merging.
          "fan_in_fan_out": layout.fan_in_fan_out, "bias": "none",
          "modules_to_save": [_HEAD_MODULES[head]] if head in _HEAD_MODULES else None,
          "init_lora_weights": True, "use_rslora": False, "use_dora": False,
          "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
          "alpha_pattern": {}, "inference_mode": True, "revision": None}


def peft_state_dict(params: Any, config: ModelConfig,
                    head: str = "pretraining") -> dict[str, np.ndarray]:
  """The adapter's tensors under peft's names: `base_model.model.<module>.lora_A.weight`
  [r, in] and `lora_B.weight` [out, r] (nn.Linear layout, also for GPT-2's Conv1D), plus the
  head module's weight and bias for `modules_to_save`."""
  layout = _check_peft_export(config, head)
  flat = unstack_layers({k: np.asarray(jax.device_get(v), np.float32)
                         for k, v in flat_params(params).items()}, config)
  prefix = layer_prefix(config)
  r = config.lora_rank
  tensors: dict[str, np.ndarray] = {}
  for i in range(config.num_layers):
    layer = prefix + (f"layers_{i}",)
    for target in config.lora_modules:
      site = LORA_SITES[target][0]
      a_name, b_name = lora_param_names(target)
      a, b = flat[layer + site + (a_name,)], flat[layer + site + (b_name,)]
      module = layout.layer.format(i) + layout.modules[target]
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
