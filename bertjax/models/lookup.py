"""How an embedding table's rows are read for a batch of ids, and what their gradient costs:
`take_rows` (a gather whose table gradient is summed in float32), `select_rows` (a small table:
each token's row picked elementwise, its gradient a float32 sum per row, no scatter) and
`one_hot_rows` (a product: `model.embed_lookup="one_hot"`). `layers.Embed` chooses among them;
guide: docs/models.md, 'Embedding lookups'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# Tables this small are read by `select_rows` (token types). A gather's backward pass is a
# scatter-add of every token's gradient into its row; into a handful of rows every update lands
# on the same few addresses: on an H200 BERT-large's 2-row token-type table's was the largest
# kernel of its step (docs/results/2026-11-28-h200-gpu-session.md).
SELECT_ROWS = 16


@jax.custom_vjp
def take_rows(table: Array, ids: Array) -> Array:
  """`jnp.take(table, ids, axis=0)` whose table gradient is summed in float32 and rounded to
  the table's dtype once. JAX's own is a scatter-add in the table's dtype, which for a bf16
  table accumulates the gradients of a row's tokens in bf16, percents off the exact sums for a
  row read by many tokens (tests/test_model_properties.py)."""
  return jnp.take(table, ids, axis=0)


def _take_rows_fwd(table: Array, ids: Array):
  # The table's row count and dtype travel as an empty array: residuals are arrays.
  return jnp.take(table, ids, axis=0), (ids, jnp.zeros((table.shape[0], 0), table.dtype))


def _take_rows_bwd(residuals, g: Array):
  ids, like = residuals
  grad = jnp.zeros((like.shape[0], g.shape[-1]), jnp.float32).at[ids].add(
      g.astype(jnp.float32))
  return grad.astype(like.dtype), None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def select_rows(table: Array, ids: Array) -> Array:
  """table[ids] for a table of at most `SELECT_ROWS` rows, as one select per row: elementwise
  work XLA fuses with what follows, and a gradient that is a masked sum over the tokens per row
  (a reduction in the table's dtype, float32 for a float32 table), with no matmul added to the
  program's FLOPs. An id outside the table reads zeros."""
  out = jnp.zeros(ids.shape + table.shape[1:], table.dtype)
  for row in range(table.shape[0]):
    out = jnp.where((ids == row)[..., None], table[row], out)
  return out


def one_hot_rows(table: Array, ids: Array) -> Array:
  """table[ids] as one-hot ids times the table. HIGHEST: full fp32 precision, so that each row
  comes out exactly (the default on TPU and GPU rounds fp32 operands to bf16 or TF32). An id
  outside the table reads zeros, where the gather reads NaN."""
  one_hot = ids[..., None] == jax.lax.broadcasted_iota(
      jnp.int32, (1,) * ids.ndim + (table.shape[0],), ids.ndim)
  return jnp.dot(one_hot.astype(table.dtype), table, precision=jax.lax.Precision.HIGHEST)
