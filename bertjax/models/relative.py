"""DeBERTa's disentangled attention (He et al. 2021; v2/v3 as transformers' DebertaV2): the
relative distance of each query-key pair, bucketed logarithmically beyond a few positions, picks
a row of a learned table that the encoder owns; each layer projects the table to position keys
and queries and adds content-to-position (c2p) and position-to-content (p2c) terms to the
content scores. Functions of the config and arrays only; the parameters live in
bertjax/models/layers.py (LayerStack's table, SelfAttention's projections).

Shape suffixes: B batch, L (query) length, S (key) length, N heads, H head dim, R table rows
(2 * span), D model width.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from bertjax.models import precision
from bertjax.models.config import ModelConfig

Array = jax.Array


@flax.struct.dataclass
class RelativePositions:
  """What every layer reads, computed once by the encoder: the (normalised) relative position
  table [R, D] and, per query-key pair, the table row its terms read [B or 1, 1, L, S]."""
  embeddings_RD: Array
  index_B1LS: Array


def max_distance(config: ModelConfig) -> int:
  """The farthest distance told apart (transformers' max_relative_positions, whose -1 means
  max_position_embeddings)."""
  return config.max_relative_positions or config.max_positions


def span(config: ModelConfig) -> int:
  """Half the table's rows (transformers' att_span / pos_ebd_size): the bucket count where
  distances are bucketed, else the farthest distance."""
  return config.position_buckets or max_distance(config)


def terms(config: ModelConfig) -> tuple[str, ...]:
  return tuple(config.relative_attention_terms.split("|"))


def score_divisor(config: ModelConfig) -> float:
  """What every score term is divided by: sqrt(H * (1 + number of position terms)), so that
  the sum of c2c, c2p and p2c keeps the variance of one term (transformers' scale_factor)."""
  return float(np.sqrt(np.float32(config.head_dim) * np.float32(1 + len(terms(config)))))


def log_buckets(distance: np.ndarray, buckets: int, max_dist: int) -> np.ndarray:
  """transformers' make_log_bucket_position: distances within buckets // 2 kept, farther ones
  mapped logarithmically so that max_dist - 1 lands on the last bucket, signs kept.

  In float32, in transformers' order of operations: the ceil of a ratio of logs decides the
  bucket, and a different rounding could move a distance at a boundary by one.
  """
  distance = np.asarray(distance, np.int64)
  mid = buckets // 2
  sign = np.sign(distance)
  abs_pos = np.where((distance < mid) & (distance > -mid), mid - 1, np.abs(distance))
  with np.errstate(divide="ignore", invalid="ignore"):
    ratio = np.log(abs_pos.astype(np.float32) / np.float32(mid))
    log_pos = np.ceil(ratio / np.log(np.float32((max_dist - 1) / mid)) * np.float32(mid - 1))
    log_pos = log_pos + np.float32(mid)
    bucketed = np.where(abs_pos <= mid, distance.astype(np.float32), log_pos * sign)
  return bucketed.astype(np.int64)


def table_rows(config: ModelConfig, length: int) -> np.ndarray:
  """For each distance q - k in -(L - 1) .. L - 1 (entry d + L - 1), the table row its c2p
  term reads: the (bucketed) distance plus the span, clipped to the table."""
  distance = np.arange(-(length - 1), length)
  if config.position_buckets:
    distance = log_buckets(distance, config.position_buckets, max_distance(config))
  return np.clip(distance + span(config), 0, 2 * span(config) - 1).astype(np.int32)


def relative_index(config: ModelConfig, length: int, positions_BL: Array | None = None
                   ) -> Array:
  """[1, 1, L, L] (or [B, 1, L, L] with `positions_BL`): the table row of each query-key pair,
  from their positions' distance (transformers' build_relative_position for 0 .. L - 1; packed
  documents restart their positions). Either way through a static table over the distances
  -(L - 1) .. L - 1, so that the float32 bucketing runs once, in NumPy, at trace time."""
  rows = table_rows(config, length)
  if positions_BL is None:
    index = np.arange(length)
    return jnp.asarray(rows[index[:, None] - index[None, :] + length - 1])[None, None]
  pos_BL = positions_BL.astype(jnp.int32)
  distance_BLS = jnp.clip(pos_BL[:, :, None] - pos_BL[:, None, :], -(length - 1), length - 1)
  return jnp.asarray(rows)[distance_BLS + length - 1][:, None]


def disentangled_scores(config: ModelConfig, q_BLNH: Array, k_BSNH: Array,
                        pos_query_RNH: Array | None, pos_key_RNH: Array | None,
                        index_B1LS: Array) -> Array:
  """The position terms of the scores, [B, N, L, S] in float32, already divided by
  `score_divisor`: c2p (query l · position key of row index[l, s]) where `pos_key_RNH` is
  given, p2c (key s · position query of the row of the distance s - l, negated) where
  `pos_query_RNH` is.

  transformers gathers p2c at clip(-bucket(s - l) + span); the bucketing is odd in the
  distance, so that is index[l, s], the c2p row: one index serves both terms.
  """
  bias_BNLS = jnp.zeros((), jnp.float32)
  if pos_key_RNH is not None:
    c2p_BNLR = precision.einsum(config, "blnh,rnh->bnlr", q_BLNH, pos_key_RNH,
                                out_dtype=jnp.float32)
    bias_BNLS = bias_BNLS + jnp.take_along_axis(c2p_BNLR, index_B1LS, axis=-1, mode="clip")
  if pos_query_RNH is not None:
    p2c_BNSR = precision.einsum(config, "bsnh,rnh->bnsr", k_BSNH, pos_query_RNH,
                                out_dtype=jnp.float32)
    # Row s of the [S, R] products read at index[l, s] for each l: gathered as [S, L], then
    # turned to [L, S].
    p2c_BNSL = jnp.take_along_axis(p2c_BNSR, jnp.swapaxes(index_B1LS, -1, -2), axis=-1,
                                   mode="clip")
    bias_BNLS = bias_BNLS + jnp.swapaxes(p2c_BNSL, -1, -2)
  return bias_BNLS / score_divisor(config)
