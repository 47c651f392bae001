"""Mixed precision: the dtype of each kind of computation, decided here and nowhere else.

Weights are stored in `model.param_dtype`. Matmuls (`einsum`, `product`) read `model.dtype` and
accumulate in float32; what they write is `model.matmul_output` ("compute", "float32", or
"auto": `resolve`, per platform). In "float32" mode `_mixed_einsum`'s custom VJP lays operands
out in the form XLA's fast CPU bf16 kernel takes and returns float32 weight gradients
unrounded. With `model.dtype=float32` nothing here changes the program.

The guide: docs/performance.md, 'Mixed precision (bf16) against the reference's best setting'.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from bertjax.models.config import ModelConfig

Array = jax.Array


def platform() -> str:
  """The platform the program being traced is compiled for: the ambient mesh's devices (a TPU
  topology's when compiling ahead of time from a CPU host), else the default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else mesh.abstract_device
  return device.platform if device is not None else jax.default_backend()


def resolve(config: ModelConfig, platform_name: str) -> ModelConfig:
  """`model.matmul_output="auto"` made concrete for programs compiled for `platform_name`."""
  if config.matmul_output != "auto":
    return config
  fast_cpu = platform_name == "cpu" and config.dtype != "float32"
  return config.replace(matmul_output="float32" if fast_cpu else "compute")


def matmul_output(config: ModelConfig) -> str:
  """"compute" or "float32": the config's mode, "auto" resolved for the traced program."""
  if config.matmul_output == "auto":
    return resolve(config, platform()).matmul_output
  return config.matmul_output


def _relaid_out(config: ModelConfig) -> bool:
  """Whether products run in the CPU mixed mode: 16-bit operands laid out for XLA's fast
  kernel, float32 results."""
  return matmul_output(config) == "float32" and config.dtype != "float32"


def activation_dtype(config: ModelConfig) -> Any:
  """The dtype matmuls write and activations travel in."""
  return jnp.float32 if matmul_output(config) == "float32" else config.compute_dtype


def einsum(config: ModelConfig, equation: str, x: Array, y: Array, *,
           out_dtype: Any = None) -> Array:
  """`jnp.einsum(equation, x, y)` under the policy: inputs in the compute dtype, float32
  accumulation, output in the activation dtype (or `out_dtype`). Each index of an operand
  appears in the other operand or in the output (the contractions of layers and attention).
  In the CPU mixed mode a custom VJP: operands laid out for the fast kernel and cotangents
  rounded to 16 bits, forward and backward (`_mixed_einsum`)."""
  dtype = config.compute_dtype
  out_dtype = activation_dtype(config) if out_dtype is None else out_dtype
  if _relaid_out(config):
    return _mixed_einsum(equation, x, y, dtype).astype(out_dtype)
  return jnp.einsum(equation, x.astype(dtype), y.astype(dtype), preferred_element_type=out_dtype)


def product(config: ModelConfig, equation: str, x: Array, y: Array) -> Array:
  """`einsum(equation, x, y)` with inputs in the compute dtype and the float32 accumulator as
  output, as a plain function (no custom VJP): for code that writes its own derivative, such
  as the chunked vocabulary loss. In the CPU mixed mode the operands are laid out for the fast
  kernel; there the output order should be [left's free axes, right's free axes], which XLA
  then need not transpose (it would do so by relaying out an operand)."""
  dtype = config.compute_dtype
  x, y = x.astype(dtype), y.astype(dtype)
  if _relaid_out(config):
    xs, ys, out = _terms(equation)
    return _fast_product(x, xs, y, ys, out)
  return jnp.einsum(equation, x, y, preferred_element_type=jnp.float32)


def _terms(equation: str) -> tuple[str, str, str]:
  inputs, out = equation.replace(" ", "").split("->")
  x, y = inputs.split(",")
  return x, y, out


def _row_major(x: Array, subscripts: str, order: str) -> Array:
  """`x` (indexed by `subscripts`) with its axes in `order`, as a real copy.

  A plain transpose would be folded into the consumer's dot as dimension numbers or a
  non-default layout, which is what sends the dot down the slow path; going through a
  transpose with an extra unit axis and a reshape makes XLA write the permuted array out in
  row-major order."""
  if subscripts == order:
    return x
  # Its own buffer first: fused with its producer (a slice of the scan's saved activations),
  # the transpose becomes a strided loop many times slower than the copy itself.
  x = jax.lax.optimization_barrier(x)
  perm = tuple(subscripts.index(c) for c in order)
  # The unit axis sits after the first permuted axis, so the final reshape is not a bitcast
  # of the transposed layout.
  expanded = jnp.expand_dims(x, x.ndim)
  moved = jnp.transpose(expanded, (perm[0], x.ndim) + perm[1:])
  return jax.lax.optimization_barrier(moved).reshape(tuple(x.shape[p] for p in perm))


def _axis_groups(xs: str, ys: str, out: str) -> tuple[str, str, str, str]:
  """The axes of einsum(xs,ys->out) by role, each in its operand's order: (batch, left's
  free, contracted, right's free)."""
  return ("".join(c for c in xs if c in ys and c in out), "".join(c for c in xs if c not in ys),
          "".join(c for c in xs if c in ys and c not in out),
          "".join(c for c in ys if c not in xs))


def _fast_layouts(xs: str, ys: str, out: str) -> tuple[str, tuple[str, str]]:
  """The axis orders XLA's CPU bf16 kernel runs einsum(xs,ys->out) in: the left operand
  [batch, free, contracted]; the right one [batch, contracted, free] or [batch, free,
  contracted]."""
  batch, x_free, contracted, y_free = _axis_groups(xs, ys, out)
  return (batch + x_free + contracted,
          (batch + contracted + y_free, batch + y_free + contracted))


def _fast_product(x: Array, xs: str, y: Array, ys: str, out: str) -> Array:
  """einsum(xs,ys->out) with its operands copied into `_fast_layouts` where they are not,
  output in float32."""
  x_order, y_orders = _fast_layouts(xs, ys, out)
  y_order = ys if ys in y_orders else y_orders[0]
  x, y = _row_major(x, xs, x_order), _row_major(y, ys, y_order)
  return _merged_einsum(x, x_order, y, y_order, out)


def _merged_einsum(x: Array, xs: str, y: Array, ys: str, out: str) -> Array:
  """einsum(xs,ys->out) in float32, as a product of matrices (or of batches of them) where
  the output is in the order [batch, left's free, right's free]: each group of axes merged
  into one. Over several contracted axes (qkv's kernel [d, 3, heads, head_dim] in its input
  gradient) XLA would relayout that operand through a transposing loop many times slower
  than a matrix transpose (docs/results/2026-11-27-unrolled-layers-cpu.md). Other output
  orders keep the einsum as it is: merged, XLA folds the output's transpose into the dot,
  which its CPU backend then upcasts to float32 or cannot run. Operands in `_fast_layouts`."""
  groups = _axis_groups(xs, ys, out)
  merge = [g for g in groups if len(g) > 1]
  if out != _natural_order(xs, ys, out) or not merge:
    return jnp.einsum(f"{xs},{ys}->{out}", x, y, preferred_element_type=jnp.float32)
  sizes = dict(zip(xs, x.shape)) | dict(zip(ys, y.shape))
  letters = iter(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in xs + ys)
  renames = {group: next(letters) for group in merge}
  sizes |= {letter: math.prod(sizes[c] for c in group) for group, letter in renames.items()}

  def renamed(subscripts: str) -> str:
    for group, letter in renames.items():
      subscripts = subscripts.replace(group, letter)
    return subscripts

  def shape(subscripts: str) -> tuple[int, ...]:
    return tuple(sizes[c] for c in subscripts)

  mx, my, mout = renamed(xs), renamed(ys), renamed(out)
  result = jnp.einsum(f"{mx},{my}->{mout}", x.reshape(shape(mx)), y.reshape(shape(my)),
                      preferred_element_type=jnp.float32)
  return result.reshape(shape(out))


def _relayout_cost(xs: str, ys: str, out: str, x_size: int, y_size: int) -> int:
  """Elements copied by `_fast_product(x, xs, y, ys, out)` to lay its operands out."""
  x_order, y_orders = _fast_layouts(xs, ys, out)
  return (0 if xs == x_order else x_size) + (0 if ys in y_orders else y_size)


def _natural_order(xs: str, ys: str, out: str) -> str:
  """The output order a product of operands in `_fast_layouts` comes out in: [batch, left's
  free, right's free]."""
  batch, x_free, _, y_free = _axis_groups(xs, ys, out)
  return batch + x_free + y_free


def _product(a: Array, a_s: str, b: Array, b_s: str, out: str) -> Array:
  """`_fast_product` with the operand order (either may be the left one) that copies less,
  counting the copy of its result into `out`'s order where that is not the natural one: an
  output transposed inside the dot is what XLA's CPU backend upcasts to float32 or cannot run
  (the attention core's backward products, whose cotangents are [batch, heads, L, S])."""
  sizes = dict(zip(a_s, a.shape)) | dict(zip(b_s, b.shape))

  def cost(xs: str, x: Array, ys: str, y: Array) -> int:
    moved = _natural_order(xs, ys, out) != out
    return (_relayout_cost(xs, ys, out, x.size, y.size)
            + (math.prod(sizes[c] for c in out) if moved else 0))

  if cost(b_s, b, a_s, a) < cost(a_s, a, b_s, b):
    a, a_s, b, b_s = b, b_s, a, a_s
  natural = _natural_order(a_s, b_s, out)
  return _row_major(_fast_product(a, a_s, b, b_s, natural), natural, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _mixed_einsum(equation: str, x: Array, y: Array, dtype: Any) -> Array:
  xs, ys, out = _terms(equation)
  return _product(x.astype(dtype), xs, y.astype(dtype), ys, out)


def _mixed_einsum_fwd(equation: str, x: Array, y: Array, dtype: Any):
  xs, ys, out = _terms(equation)
  x16, y16 = x.astype(dtype), y.astype(dtype)
  # The 16-bit copies are the residuals (half the bytes of float32 ones), with the original
  # dtypes the cotangents must have. The barrier keeps them 16-bit: left alone, XLA saves the
  # float32 input and converts it in the backward pass, fused into a slow transposing loop.
  x16, y16 = jax.lax.optimization_barrier((x16, y16))
  return _product(x16, xs, y16, ys, out), (x16, y16, jnp.zeros((), x.dtype),
                                           jnp.zeros((), y.dtype))


def _mixed_einsum_bwd(equation: str, dtype: Any, residuals, g: Array):
  xs, ys, out = _terms(equation)
  x16, y16, x_like, y_like = residuals
  g16 = g.astype(dtype)
  gx = _product(g16, out, y16, ys, xs).astype(x_like.dtype)
  gy = _product(x16, xs, g16, out, ys).astype(y_like.dtype)
  return gx, gy


_mixed_einsum.defvjp(_mixed_einsum_fwd, _mixed_einsum_bwd)
