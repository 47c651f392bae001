"""Parameter-efficient tuning on parameter trees: `trainable_params` / `combine` (a fine-tuned
checkpoint need hold only what training changed and name its base; loading puts the two back
together), `report` (trainable against total, and per LoRA target what the update costs against
the projection it updates) and `merge_lora` (W + (alpha/r)·A·B folded into each kernel: a plain
model of the base architecture, which `bertjax.hf.export_hf` exports unchanged).

The additions themselves are model options built by bertjax/models/layers.py (docs/finetuning.md,
'Parameter-efficient tuning'); `bertjax.models.groups.is_added` is the one test of whether a
parameter is one, and everything here goes through it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from bertjax.models.config import ModelConfig
from bertjax.models.groups import encoder_path, frozen_rows, is_added
from bertjax.models.lora import LORA_SITES, lora_param_names
from bertjax.models.params import layer_prefix, stack_layers, unstack_layers

Flat = dict[tuple[str, ...], Any]

# The model options that add parameters, and what each is when off.
_ADDITIONS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "adapter_size",
              "prefix_length")

def flat_params(params: Any) -> Flat:
  return traverse_util.flatten_dict(nn.meta.unbox(params))


def _defaults() -> dict[str, Any]:
  return {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in _ADDITIONS}


def has_additions(params: Any) -> bool:
  """Whether `params` holds any LoRA, adapter or prefix parameter."""
  return any(is_added(key) for key in flat_params(params))


def without_additions(params: Any) -> Any:
  """The base model's parameters: `params` with every addition left out."""
  return traverse_util.unflatten_dict({k: v for k, v in flat_params(params).items()
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
  flags = flat_params(frozen_rows(params, freeze))
  return traverse_util.unflatten_dict({k: v for k, v in flat_params(params).items()
                                       if flags[k] is not True})


def combine(base_params: Any, trainable: Any) -> Any:
  """`base_params` with `trainable` (from `trainable_params`) put in: its leaves replace the
  base's of the same path, and the additions the base lacks are added. A leaf whose shape
  differs from the base's is a checkpoint of another model: ValueError naming it."""
  out = flat_params(base_params)
  for key, value in flat_params(trainable).items():
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
  flat = flat_params(params)
  flags = flat_params(frozen_rows(params, freeze))
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
             "heads" if encoder_path(key) is None else "encoder")
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
  flat = unstack_layers({k: np.asarray(jax.device_get(v)) for k, v in flat_params(params).items()},
                        config)
  prefix = layer_prefix(config)
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
