"""Device meshes and the logical-axis rules table that maps model axis names to mesh axes.

Model code names logical axes only (batch, length, embed, heads, kv, qkv, mlp, vocab, layers).
A rules table, a list of `(logical_name, mesh_axes)` pairs held in the config, says which mesh
axes shard each name. Rules are applied in order and a mesh axis is used at most once per
array, so with the default table an activation [batch, length, embed] shards batch over
(data, fsdp) and leaves embed whole, while a weight [embed, mlp] shards embed over fsdp (ZeRO-3)
and mlp over tensor (Megatron).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from bertjax.models import init_compiler_options

log = logging.getLogger(__name__)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# The mesh axis names every config uses, outermost first. `data` is pure data parallelism
# (replicated parameters), `fsdp` shards data *and* parameters/optimizer state (ZeRO-3),
# `tensor` splits heads, MLP and vocabulary (Megatron). On several TPU slices each axis is
# split again over the slices (`dcn_mesh`, data parallel across slices by default).
MESH_AXES = ("data", "fsdp", "tensor")

# Presets of the rules table. Each works on any mesh; axes of size 1 shard nothing, so the
# mesh shape decides how much of each kind of parallelism actually happens.
RULE_PRESETS: dict[str, list[tuple[str, Any]]] = {
    # Replicated parameters, batch split over every device.
    "data_parallel": [("batch", ("data", "fsdp", "tensor"))],
    # ZeRO-3: batch over data+fsdp, every weight's embed dimension over fsdp.
    "fsdp": [("batch", ("data", "fsdp")), ("embed", "fsdp")],
    # Megatron: heads, MLP hidden and vocabulary over tensor; batch over data.
    "tensor": [("batch", "data"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor")],
    # All three (the default): 3-D parallelism.
    "fsdp_tensor": [("batch", ("data", "fsdp")), ("heads", "tensor"), ("mlp", "tensor"),
                    ("vocab", "tensor"), ("embed", "fsdp")],
}


def resolve_rules(rules: str | Rules) -> list[tuple[str, Any]]:
  """A preset name or an explicit table -> a list of (logical, mesh axes) pairs."""
  if isinstance(rules, str):
    if rules not in RULE_PRESETS:
      raise ValueError(f"unknown sharding rules preset {rules!r}; presets: "
                       f"{', '.join(RULE_PRESETS)}")
    return list(RULE_PRESETS[rules])
  return [(name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules]


def mesh_shape(axis_sizes: Mapping[str, int], num_devices: int,
               what: str = "mesh") -> tuple[int, ...]:
  """Sizes per MESH_AXES with one -1 meaning "all remaining devices", validated. `what` names
  the config group in errors ("mesh", or "dcn_mesh" over slices)."""
  unknown = sorted(set(axis_sizes) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"unknown {what} axis {', '.join(unknown)}; mesh axes are "
                     f"{', '.join(MESH_AXES)}")
  sizes = [int(axis_sizes.get(name, 1)) for name in MESH_AXES]
  unit = "slices" if what == "dcn_mesh" else "devices"
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one {what} axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"{what} axis sizes must be positive or -1, got "
                     f"{dict(zip(MESH_AXES, sizes))}")
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % fixed:
      raise ValueError(f"{what} {dict(zip(MESH_AXES, sizes))}: {num_devices} {unit} are not "
                       f"divisible by the fixed axes' product {fixed}")
    sizes[sizes.index(-1)] = num_devices // fixed
  if math.prod(sizes) != num_devices:
    raise ValueError(f"{what} {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} {unit} "
                     f"but {num_devices} are available")
  return tuple(sizes)


def num_slices(devices: Sequence[Any]) -> int:
  """TPU slices the devices span (multi-slice devices carry `slice_index`; others: 1)."""
  return len({getattr(d, "slice_index", 0) or 0 for d in devices})


def make_mesh(axis_sizes: Mapping[str, int], devices: Sequence[Any] | None = None,
              dcn_sizes: Mapping[str, int] | None = None) -> Mesh:
  """A mesh over `devices` (default: all) with Auto axis types (GSPMD propagation).

  `axis_sizes` lay the axes over the devices of one slice (ICI, in torus order);
  `dcn_sizes` over the slices of a multi-slice job (DCN, default: data parallel across
  slices). Each mesh axis is then dcn x ici devices long, slices outermost, built with
  `mesh_utils.create_hybrid_device_mesh`."""
  devices = list(jax.devices() if devices is None else devices)
  slices = num_slices(devices)
  if len(devices) % slices:
    raise ValueError(f"{len(devices)} devices do not split evenly into {slices} slices")
  dcn = mesh_shape(dict(dcn_sizes) if dcn_sizes else {"data": -1}, slices, "dcn_mesh")
  ici = mesh_shape(axis_sizes, len(devices) // slices)
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  if slices == 1:
    return jax.make_mesh(ici, MESH_AXES, axis_types=axis_types, devices=devices)
  grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                              allow_split_physical_axes=True)
  return Mesh(grid, MESH_AXES, axis_types=axis_types)


def mesh_from_config(config: Any, devices: Sequence[Any] | None = None) -> Mesh:
  """The run's mesh: `config.mesh` within a slice, `config.dcn_mesh` across slices."""
  dcn = config.get("dcn_mesh")
  return make_mesh({k: int(v) for k, v in dict(config.mesh).items()}, devices,
                   {k: int(v) for k, v in dict(dcn).items()} if dcn else None)


def batch_axes(rules: Rules) -> tuple[str, ...]:
  """The mesh axes the rules shard the `batch` dimension over."""
  axes = nn.logical_to_mesh_axes(("batch",), rules)[0] or ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def batch_ways(mesh: Mesh, rules: Rules) -> int:
  """Into how many row blocks the rules split a batch on `mesh` (its data-parallel width)."""
  return math.prod(mesh.shape[a] for a in batch_axes(rules))


def check_batch(batch_size: int, accum_steps: int, mesh: Mesh, rules: Rules) -> None:
  """A ValueError naming the numbers when a batch (or its micro-batches) cannot be split
  evenly over the mesh's data-parallel ways."""
  ways = batch_ways(mesh, rules)
  if batch_size < 1 or accum_steps < 1 or batch_size % accum_steps or (
      (batch_size // accum_steps) % ways):
    raise ValueError(
        f"batch_size={batch_size} with grad_accum_steps={accum_steps} gives micro-batches of "
        f"{batch_size / max(accum_steps, 1):g} sequences, not divisible by the {ways} "
        f"data-parallel ways of mesh {dict(mesh.shape)} (the sharding rules put 'batch' on "
        f"{', '.join(batch_axes(rules)) or 'no axis'})")


def logical_specs(boxed_tree: Any) -> Any:
  """The tree of logical PartitionSpecs (axis names) of a boxed parameter tree."""
  return nn.get_partition_spec(boxed_tree)


def _divisible_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh,
                    name: str) -> PartitionSpec:
  """Drops mesh axes that do not divide a dimension, loudly (never silently replicated)."""
  fixed = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    if axes is None:
      fixed.append(None)
      continue
    axes_tuple = axes if isinstance(axes, tuple) else (axes,)
    kept = []
    for axis in axes_tuple:
      if dim % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]) == 0:
        kept.append(axis)
      else:
        log.warning("%s: dimension %d is not divisible by mesh axis %r (size %d); that axis "
                    "does not shard it", name, dim, axis, mesh.shape[axis])
    fixed.append(tuple(kept) if len(kept) > 1 else (kept[0] if kept else None))
  return PartitionSpec(*fixed)


def shardings_for(abstract_boxed: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings for every leaf of a boxed abstract tree, from its logical axis names."""
  specs = nn.logical_to_mesh(logical_specs(abstract_boxed), rules)
  unboxed = nn.meta.unbox(abstract_boxed)

  def to_sharding(path, spec, leaf):
    name = jax.tree_util.keystr(path)
    spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec()
    return NamedSharding(mesh, _divisible_spec(spec, leaf.shape, mesh, name))

  return jax.tree_util.tree_map_with_path(
      to_sharding, specs, unboxed, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None)


def abstract_with(tree: Any, shardings: Any | None = None) -> Any:
  """ShapeDtypeStructs of `tree`'s leaves carrying `shardings` (a tree like it; None: this
  process's first device): what a checkpoint restores into and a step compiles against,
  allocating nothing."""
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree.map(lambda _: device, tree)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s),
                      tree, shardings)


def sharded_init(init_fn: Callable[[jax.Array], Any], rng: jax.Array, mesh: Mesh,
                 rules: Rules) -> tuple[Any, Any]:
  """Creates a tree directly in its shardings: eval_shape, then jit with out_shardings.

  No device ever holds an unsharded copy. Returns (unboxed tree, its shardings).
  """
  abstract = jax.eval_shape(init_fn, rng)
  shardings = shardings_for(abstract, mesh, rules)
  with nn.logical_axis_rules(rules):
    tree = jax.jit(lambda r: nn.meta.unbox(init_fn(r)), out_shardings=shardings,
                   compiler_options=init_compiler_options())(rng)
  return tree, shardings


def describe(tree: Any) -> str:
  """One line per leaf: path, shape, sharding spec, bytes per device."""
  lines = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    spec = leaf.sharding.spec if isinstance(leaf.sharding, NamedSharding) else "?"
    per_device = leaf.addressable_shards[0].data.nbytes
    lines.append(f"{jax.tree_util.keystr(path):70s} {str(tuple(leaf.shape)):22s} {str(spec):40s}"
                 f" {per_device / 2**20:9.2f} MiB/device")
  return "\n".join(lines)


def sharded_fraction(array: jax.Array) -> float:
  """Fraction of the array's elements one device holds (1.0 = replicated)."""
  return float(np.prod(array.addressable_shards[0].data.shape) / max(1, np.prod(array.shape)))
