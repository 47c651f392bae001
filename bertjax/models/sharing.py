"""Cross-layer parameter sharing (ALBERT, Lan et al. 2020, Section 3.1 and Table 4): the layer
stack of a `model.layer_sharing` setting, and the stored layout of a partly shared one.

"all" is LayerStack's own (bertjax/models/layers.py: one Block, `shared_layer`, broadcast into
the scanned loop). "attention" and "ffn" share one sub-block of every layer: the stored tree
holds it once, under `shared_layer`, beside the other sub-block's per-layer parameters
(`layers` with a leading layer axis, or `layers_{i}`), and the LayerStack inside sees the usual
per-layer tree through nn.map_variables. Its gradient is the sum over the layers: the
broadcast's (scanned) or the reuse's (unrolled).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models.config import ModelConfig
from bertjax.models.groups import SHARED_LAYER
from bertjax.models.layers import LayerStack

# The Block submodules each setting shares: a sub-block with its LayerNorm (transformers'
# AlbertAttention holds the attention's; the FFN's closes the layer).
SHARED_PARTS = {"none": (), "all": ("attention", "attention_norm", "mlp", "mlp_norm"),
                "attention": ("attention", "attention_norm"), "ffn": ("mlp", "mlp_norm")}

# The scanned stack's leading axis, as nn.scan names it in the parameters' logical axes.
_LAYER_AXIS = {nn.PARTITION_NAME: "layers"}


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def _box_map(fn: Callable[[Any], Any], axis: Callable[[Any], Any], leaf: Any) -> Any:
  """`fn` on a parameter's value; on a boxed (logically partitioned) one also `axis` on its
  box, so that its axis names keep matching its shape."""
  if _is_box(leaf):
    return axis(leaf).replace_boxed(fn(leaf.value))
  return fn(leaf)


def split_shared(variables: dict[str, Any], parts: tuple[str, ...]) -> dict[str, Any]:
  """The per-layer tree LayerStack creates -> the stored layout: layer 0's `parts` (its
  initialisation; every layer's was drawn alike) under `shared_layer`, the other submodules
  per layer as before."""
  params = dict(variables.get("params", {}))
  if not params or SHARED_LAYER in params:
    return variables
  if "layers" in params:  # scanned: the shared parts lose their leading layer axis
    layers = dict(params["layers"])
    first = functools.partial(_box_map, lambda x: x[0], lambda b: b.remove_axis(0, _LAYER_AXIS))
    shared = {name: jax.tree.map(first, layers.pop(name), is_leaf=_is_box) for name in parts}
    params["layers"] = layers
  else:
    names = [k for k in params if k.startswith("layers_")]
    shared = {name: params["layers_0"][name] for name in parts}
    for key in names:
      params[key] = {k: v for k, v in params[key].items() if k not in parts}
  params[SHARED_LAYER] = shared
  return {**variables, "params": params}


def join_shared(variables: dict[str, Any]) -> dict[str, Any]:
  """The stored layout -> the per-layer tree LayerStack reads: the shared parts handed to every
  layer (scanned: broadcast along the layer axis; unrolled: the same arrays in every layer)."""
  params = dict(variables.get("params", {}))
  if SHARED_LAYER not in params:
    return variables
  shared = params.pop(SHARED_LAYER)
  if "layers" in params:
    num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
    stack = functools.partial(_box_map, lambda x: jnp.broadcast_to(x, (num_layers,) + x.shape),
                              lambda b: b.add_axis(0, _LAYER_AXIS))
    params["layers"] = {**params["layers"],
                        **jax.tree.map(stack, shared, is_leaf=_is_box)}
  else:
    for key in [k for k in params if k.startswith("layers_")]:
      params[key] = {**params[key], **shared}
  return {**variables, "params": params}


@functools.cache
def _partly_shared_stack(parts: tuple[str, ...]) -> type[nn.Module]:
  # mutable=True, not init=True: the per-layer view goes in, and the parameters LayerStack
  # creates come out split (at init; otherwise they are immutable and not handed back), with
  # LayerStack run once.
  return nn.map_variables(LayerStack, "params", trans_in_fn=join_shared,
                          trans_out_fn=functools.partial(split_shared, parts=parts),
                          mutable=True)


def layer_stack(config: ModelConfig) -> nn.Module:
  """The encoder's layer stack for `config.layer_sharing` (a submodule: name it by assignment
  in `setup`). Scanned, a partly shared stack broadcasts its shared sub-block along the layer
  axis for the loop: the weights and gradients of an unshared sub-block are temporaries of the
  step, while the optimizer state and checkpoints hold one copy ("all" is a loop constant,
  with no such temporaries)."""
  if config.layer_sharing in ("none", "all"):
    return LayerStack(config)
  return _partly_shared_stack(SHARED_PARTS[config.layer_sharing])(config)
