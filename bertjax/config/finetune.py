"""Fine-tuning settings by their friendly names — the `bertjax finetune` flags and the keys of the
`--recipe` presets (bertjax.finetune.recipes) — and the run config they make.

Each name sets one or more keys of the run config: a fine-tuning run is a config of the one
training loop (`finetune_run_config`), and `bertjax train --config configs/finetune.py` with the
same keys runs the same thing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from bertjax.config import phases
from bertjax.config.overrides import apply_override
from bertjax.config.schema import FINETUNE_KEYS, finetune_config, model_config
from bertjax.config.validate import validate_training
from bertjax.models.config import ModelConfig

# Friendly name -> (the config keys it sets, help). The finetune group's keys are offered under
# their own names (help from the schema).
SETTINGS: dict[str, tuple[tuple[str, ...], str]] = {
    **{key: ((f"finetune.{key}",), text) for key, (_, text) in FINETUNE_KEYS.items()
       if key not in ("train", "dev")},
    "optimizer": (("optimizer.name",), "adamw | stable_adamw | lamb | adafactor"),
    "schedule": (("optimizer.schedule",), "after warmup: linear | cosine | constant | wsd"),
    "learning_rate": (("optimizer.learning_rate",), "peak learning rate"),
    "head_learning_rate": (("optimizer.head_learning_rate",),
                           "the new head's peak learning rate (0: learning_rate)"),
    "batch_size": (("batch_size",), "training batch size (rows)"),
    "grad_accum_steps": (("grad_accum_steps",), "micro-batches per step, accumulated inside "
                         "the step (batch_size must divide by it)"),
    "seq_length": (("seq_length",), "tokens per row: a sentence (pair), a question-answering "
                   "window, a packed completion row, an encoder-decoder's input"),
    "weight_decay": (("optimizer.weight_decay",), "decoupled weight decay"),
    "clip_norm": (("optimizer.clip_norm",), "global-norm gradient clipping (0: off)"),
    "freeze": (("optimizer.freeze",), "none | embeddings | bottom:K | all_but_head | base "
               "(only the LoRA/adapter/prefix parameters and the head train)"),
    "eval_every": (("eval_every",), "score the dev set every N steps (0: every epoch)"),
    "lora_rank": (("model.lora_rank",), "LoRA rank (0: off)"),
    "lora_alpha": (("model.lora_alpha",), "LoRA alpha: the update is scaled by alpha/rank"),
    "lora_dropout": (("model.lora_dropout",), "dropout on the LoRA branch's input"),
    "lora_targets": (("model.lora_targets",), "LoRA targets, comma-separated: BERT query,key,"
                     "value,out,wi,wo; GPT qkv,out,wi,wo (empty: BERT query,value, GPT qkv)"),
    "adapter_size": (("model.adapter_size",), "bottleneck adapters' width (0: off)"),
    "prefix_length": (("model.prefix_length",), "learned key/value prefixes per layer (0: off)"),
    "seed": (("seed", "data.seed"), "seed of initialisation, dropout and the order of the rows"),
    "step": (("init_step",), "with a training workdir as init_from: its step (-1: latest)"),
    "rules": (("sharding_rules",), "logical-axis rules preset"),
    "log_every": (("log_every",), "log train metrics every N steps"),
    "resume_with_changes": (("resume_with_changes",), "continue a run in OUT although the "
                            "config changed what it computes (e.g. more epochs)"),
}


def finetune_run_config(values: Mapping[str, Any], overrides: Sequence[tuple[str, str]] = (),
                        validate: bool = True) -> ml_collections.ConfigDict:
  """The run config of a fine-tune: `finetune_config()` with `values` (friendly names, plus
  `init_from`, `train`, `dev`, `mesh` ({"data": 4, ...}) and `model` (a ModelConfig to start
  from at random)) set, then the `--config.*` `overrides`; validated unless `validate` is
  False (a config file's get_config: its loader validates after the overrides)."""
  values = dict(values)
  model = values.pop("model", None)
  config = finetune_config(ml_collections.ConfigDict(dataclasses.asdict(model))
                           if isinstance(model, ModelConfig) else None)
  for key in ("init_from",):
    if values.get(key) is not None:
      config[key] = str(values.pop(key))
  for key in ("train", "dev"):
    if values.get(key) is not None:
      config.finetune[key] = str(values.pop(key))
  for axis, size in (values.pop("mesh", None) or {}).items():
    if axis not in config.mesh:
      raise ValueError(f"unknown mesh axis {axis!r}; axes: {', '.join(config.mesh)}")
    config.mesh[axis] = int(size)
  for name, value in values.items():
    if value is None:
      continue
    if name not in SETTINGS:
      raise ValueError(f"unknown fine-tuning setting {name!r}; settings: "
                       f"{', '.join(sorted(SETTINGS))}")
    for key in SETTINGS[name][0]:
      _set(config, key, value)
  for key, text in overrides:
    apply_override(config, key, text)
  if not validate:
    return config
  model_config(config)  # fails early, naming the key, on an invalid model group
  validate_training(config)
  phases.validate(config)
  return config


def _set(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
  *groups, last = key.split(".")
  node = config
  for group in groups:
    node = node[group]
  current = node[last]
  node[last] = type(current)(value) if not isinstance(current, bool) else bool(value)
