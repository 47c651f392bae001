"""Which parameter is what, read from its path: the encoder (its embeddings and layers), the
heads outside it, and the parameter-efficient additions (LoRA, adapters, prefixes); and what an
`optimizer.freeze` setting leaves untrained. Optimizers, PEFT checkpoints, weight loading and
reports all ask here.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

# Names (of a leaf or of a module on its path) that start with one of these are the
# parameter-efficient additions: LoRA's `lora_a*`/`lora_b*`, the adapters' `adapter_*`
# modules, the prefixes' `prefix_key`/`prefix_value` (bertjax/models/layers.py names them).
ADDED_PREFIXES = ("lora_", "adapter_", "prefix_")


def is_added(names: tuple[str, ...]) -> bool:
  """Whether the parameter at path `names` is a parameter-efficient addition (not part of the
  base model): the one test every other module (freezing, adapters.py, reports) uses."""
  return any(name.startswith(ADDED_PREFIXES) for name in names)


# The encoder's embedding tables, their norm and projection (BERT, ELECTRA, DeBERTa) / the
# token and position tables (GPT).
EMBEDDINGS = ("word_embeddings", "position_embeddings", "token_type_embeddings",
              "embeddings_norm", "embeddings_project", "wte", "wpe")
# DeBERTa's relative position table and its norm: the encoder's, outside its layers.
RELATIVE_TABLES = ("rel_embeddings", "rel_embeddings_norm")
FREEZE_KINDS = ("none, embeddings, bottom:K (the embeddings and layers 0..K-1), encoder or "
                "base (all but the LoRA/adapter/prefix additions and the heads)")


def parse_freeze(freeze: str) -> tuple[str, int]:
  """`optimizer.freeze`: "none" | "embeddings" | "bottom:K" | "encoder" (alias "all_but_head",
  feature extraction) | "base" (parameter-efficient tuning: only the additions of
  bertjax/models/peft.py and the heads outside the encoder train, as peft's modules_to_save)
  -> (kind, K)."""
  if freeze in ("none", "embeddings", "encoder", "base"):
    return freeze, 0
  if freeze == "all_but_head":
    return "encoder", 0
  match = re.fullmatch(r"bottom:(\d+)", freeze)
  if match:
    return "bottom", int(match.group(1))
  raise ValueError(f"freeze must be {FREEZE_KINDS}, got {freeze!r}")


def names_of(path) -> tuple[str, ...]:
  return tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def encoder_path(names: tuple[str, ...]) -> tuple[str, ...] | None:
  """The path inside the encoder (BERT: the `bert` subtree; GPT: the whole model, whose LM head
  is the tied embedding), or None for a head parameter."""
  if names[0] == "bert":
    return names[1:]
  if names[0] in ("decoder", "wte", "wpe", "final_norm"):
    return names
  return None


# Where a layer stack with cross-layer sharing (ALBERT's `model.layer_sharing`) keeps the
# parameters its layers hold in common (bertjax/models/layers.py), beside the per-layer `layers`
# / `layers_{i}`: a name of its own, so that the scanned <-> per-layer conversions
# (bertjax/models/params.py) leave it whole.
SHARED_LAYER = "shared_layer"


def layer_count(params: Any) -> int:
  """Layers of the encoder's stack that have parameters of their own: the leading axis of a
  scanned stack, else the number of `layer_i` subtrees (0 for a fully shared stack, whose one
  `shared_layer` every layer uses)."""
  unscanned = set()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    inner = encoder_path(names_of(path))
    if inner and len(inner) > 2 and inner[0] in ("encoder", "decoder"):
      if inner[1] == "layers":
        return int(np.shape(leaf)[0])
      if inner[1].startswith("layers_"):
        unscanned.add(inner[1])
  return len(unscanned)


def frozen_rows(params: Any, freeze: str) -> Any:
  """Per leaf: True (frozen whole), False (trained), or a bool array [layers, 1, ...] that is
  True for the frozen layers of a scanned layer stack."""
  kind, k = parse_freeze(freeze)
  num_layers = layer_count(params)
  if kind == "bottom" and k and _has_shared_layer(params):
    raise ValueError(f"optimizer.freeze=bottom:{k}: the encoder's layers share parameters "
                     "(model.layer_sharing), which the layers above K use too; freeze the "
                     "whole encoder (optimizer.freeze=encoder) or the embeddings")
  if kind == "bottom" and k > num_layers:
    raise ValueError(f"optimizer.freeze=bottom:{k} but the model has {num_layers} layers")

  def rule(path, leaf):
    names = names_of(path)
    inner = encoder_path(names)
    if inner is None or kind == "none":
      return False
    if kind == "base":
      return not is_added(names)
    if (kind == "encoder" or inner[0] in EMBEDDINGS
        or (inner[0] == "encoder" and inner[1] in RELATIVE_TABLES)):
      return True
    if kind != "bottom" or inner[0] not in ("encoder", "decoder") or inner[1] == SHARED_LAYER:
      return False  # a shared layer is refused above unless K is 0
    if inner[1] == "layers":  # scanned: the leading axis is the layer
      if k >= num_layers:
        return True
      if k == 0:
        return False
      rows = np.arange(num_layers) < k
      return rows.reshape((num_layers,) + (1,) * (len(np.shape(leaf)) - 1))
    return int(inner[1].split("_")[1]) < k
  return jax.tree_util.tree_map_with_path(rule, params)


def _has_shared_layer(params: Any) -> bool:
  for path, _ in jax.tree_util.tree_leaves_with_path(params):
    inner = encoder_path(names_of(path))
    if inner and len(inner) > 1 and inner[0] == "encoder" and inner[1] == SHARED_LAYER:
      return True
  return False


def parameter_groups(params: Any, freeze: str = "none") -> Any:
  """Per leaf: "frozen" (no update, no optimizer state), "encoder" or "head"."""
  return jax.tree_util.tree_map_with_path(
      lambda path, f: ("frozen" if f is True else
                       "encoder" if encoder_path(names_of(path)) is not None else "head"),
      frozen_rows(params, freeze))
