"""Parameter trees apart from any module: counts, and the scanned vs. per-layer layouts.

Flat dicts are keyed by parameter path. Scanned models keep one `layers` entry per parameter
with a leading layer axis; unrolled ones `layers_0`, `layers_1`, ... (Hugging Face's order).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from bertjax.models.config import ModelConfig

Flat = dict[tuple[str, ...], Any]


def count_params(params: Any) -> int:
  leaves = jax.tree.leaves(nn.meta.unbox(params))
  return int(sum(np.prod(leaf.shape) for leaf in leaves))


def layer_prefix(cfg: ModelConfig) -> tuple[str, ...]:
  """Where the layer stack of an encoder or decoder (BERT, GPT) sits in the parameter tree."""
  stacks = layer_stacks(cfg)
  if len(stacks) != 1:
    raise ValueError(f"a {cfg.family} model has {len(stacks)} layer stacks: see layer_stacks")
  return stacks[0][0]


def layer_stacks(cfg: ModelConfig) -> list[tuple[tuple[str, ...], int]]:
  """(where in the parameter tree, depth) of each layer stack: an encoder-decoder's encoder and
  decoder, or the one stack of the other models."""
  return cfg.family_record.layer_stacks(cfg)


def unstack_layers(flat: Flat, cfg: ModelConfig) -> Flat:
  """Scanned layout (`layers` with a leading layer axis) -> `layers_{i}` entries."""
  if not cfg.scan_layers:
    return dict(flat)
  out: Flat = dict(flat)
  for prefix, depth in layer_stacks(cfg):
    for key in [k for k in out if k[:len(prefix) + 1] == prefix + ("layers",)]:
      value = out.pop(key)
      for i in range(depth):
        out[prefix + (f"layers_{i}",) + key[len(prefix) + 1:]] = value[i]
  return out


def stack_layers(flat: Flat, cfg: ModelConfig) -> Flat:
  """`layers_{i}` entries -> the scanned layout, when the config scans layers."""
  if not cfg.scan_layers:
    return dict(flat)
  out: Flat = dict(flat)
  for prefix, depth in layer_stacks(cfg):
    grouped: dict[tuple[str, ...], list[Any]] = {}
    for key in [k for k in out if k[:len(prefix)] == prefix and len(k) > len(prefix)
                and k[len(prefix)].startswith("layers_")]:
      i = int(key[len(prefix)].split("_")[1])
      grouped.setdefault(key[len(prefix) + 1:], [None] * depth)[i] = out.pop(key)
    for rest, values in grouped.items():
      out[prefix + ("layers",) + rest] = np.stack(values)
  return out


def unscanned(params: Any, cfg: ModelConfig) -> tuple[Any, ModelConfig]:
  """The same weights laid out for an unrolled layer stack, and its config.

  Decoding wants unrolled layers: under nn.scan the KV cache is a scanned carry, copied
  whole through the scan at every new token (docs/generation.md measures the difference).
  """
  if not cfg.scan_layers:
    return params, cfg
  flat = unstack_layers(traverse_util.flatten_dict(nn.meta.unbox(params)), cfg)
  return traverse_util.unflatten_dict(flat), cfg.replace(scan_layers=False)


def shape_mismatches(have: dict[str, Any], want: dict[str, Any], want_name: str,
                     missing: bool = True) -> list[str]:
  """One line per parameter (flat name -> array or shape struct) whose shape in `have` is not
  the one `want` (named `want_name`: "model", "config") has; names only in `have`; and with
  `missing`, names only in `want`."""
  shape = lambda x: tuple(np.shape(x))  # noqa: E731
  problems = [f"{k}: {shape(have[k])} vs {want_name} {shape(v)}" for k, v in want.items()
              if k in have and shape(have[k]) != shape(v)]
  if missing:
    problems += [f"{k}: missing, {want_name} has {shape(v)}" for k, v in want.items()
                 if k not in have]
  problems += [f"{k}: not in the {want_name}" for k in have if k not in want]
  return problems
