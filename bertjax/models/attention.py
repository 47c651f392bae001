"""The attention core, softmax(q kᵀ / sqrt(H) + mask) v, in three implementations behind one
config key (`model.attention`); guide: docs/models.md, 'Attention implementations'.

"xla": einsums and an fp32 softmax, on every device; the only one with attention dropout, a score
bias (ALiBi, DeBERTa's relative positions) or a KV cache. "splash": the Pallas TPU
splash-attention kernel, run per device under `shard_map` over the ambient mesh, since Mosaic
kernels cannot be partitioned automatically (Pallas interpret mode off TPU). "cudnn":
`jax.nn.dot_product_attention`, cuDNN's fused kernel. "auto" (`resolve`): the compiled-for
platform's fused kernel where it supports the configuration, else "xla". Masks travel as an
`AttentionMask`, the dense mask and the structured form the kernels read, built together so
that they agree on every non-padding position.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from bertjax.models import precision
from bertjax.models.config import ModelConfig
from bertjax.models.dropout import Dropout

Array = jax.Array
# The name of the attention output (and the splash kernel's residuals), kept by the "dots"
# remat policy.
CONTEXT_NAME = "attention_context"


@flax.struct.dataclass
class AttentionMask:
  """Who may attend to whom.

  `dense_B1LS`: True where query l may read key s (the XLA path). `segment_ids_BL`: int ids,
  a query reads only keys with its own id (packed documents; padding is its own id 0), or None
  when every key is in one segment. `causal`: keys after the query are masked too. BERT's
  padding is segment 0 against 1 for tokens: the fused kernels then let padded queries read
  padded keys where the dense mask lets them read tokens; outputs at padded positions are
  never used.
  """
  dense_B1LS: Array
  segment_ids_BL: Array | None = None
  causal: bool = flax.struct.field(pytree_node=False, default=False)


def encoder_mask(attention_mask_BL: Array, document_ids_BL: Array | None = None
                 ) -> AttentionMask:
  """BERT: every token reads every non-padding key (1 = token, 0 = padding) — of its own
  document, when `document_ids` number the documents packed into a row (0 = padding)."""
  valid_BL = attention_mask_BL.astype(bool)
  if document_ids_BL is None:
    return AttentionMask(valid_BL[:, None, None, :], valid_BL.astype(jnp.int32))
  segments_BL = jnp.where(valid_BL, document_ids_BL, 0).astype(jnp.int32)
  same_BLS = segments_BL[:, :, None] == segments_BL[:, None, :]
  return AttentionMask((same_BLS & valid_BL[:, None, :])[:, None], segments_BL)


def decoder_mask(length: int, document_ids_BL: Array | None = None,
                 attention_mask_BL: Array | None = None) -> AttentionMask:
  """GPT: causal, within one document, and not onto padding.

  `document_ids` number the documents packed into a row (0 = padding), so packed documents
  never attend to each other; `attention_mask` (1 = token, 0 = padding) masks padded keys.
  """
  dense = jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]
  segments = None
  if document_ids_BL is not None:
    dense = dense & (document_ids_BL[:, :, None] == document_ids_BL[:, None, :])[:, None]
    segments = document_ids_BL.astype(jnp.int32)
  if attention_mask_BL is not None:
    valid_BL = attention_mask_BL.astype(bool)
    dense = dense & valid_BL[:, None, None, :]
    # Padding becomes its own segment; a causal query always reads itself, so no row of the
    # structured mask is empty.
    segments = jnp.where(valid_BL, 1 if segments is None else segments + 1, 0).astype(
        jnp.int32)
  return AttentionMask(dense, segments, causal=True)


def cross_mask(decoder_length: int, encoder_mask_BS: Array,
               encoder_segments_BS: Array | None = None,
               decoder_segments_BL: Array | None = None) -> AttentionMask:
  """An encoder-decoder's cross-attention: each decoder position reads the encoder's
  non-padding positions (1 = token, 0 = padding) — of its own packed example, when segment
  ids number the examples packed into the rows of both (0 = padding)."""
  valid_B1S = encoder_mask_BS.astype(bool)[:, None, :]
  if encoder_segments_BS is None or decoder_segments_BL is None:
    dense_BLS = jnp.broadcast_to(valid_B1S, (valid_B1S.shape[0], decoder_length,
                                             valid_B1S.shape[2]))
  else:
    dense_BLS = (decoder_segments_BL[:, :, None] == encoder_segments_BS[:, None, :]) & valid_B1S
  return AttentionMask(dense_BLS[:, None])


def kv_cache(module: nn.Module, k_BLNH: Array, v_BLNH: Array, mask: AttentionMask
             ) -> tuple[Array, Array, AttentionMask]:
  """A self-attention's KV cache in generation (the "cache" collection of `module`:
  `cached_key`/`cached_value` [B, S, N, H] and `cache_index`, the slot the next token is written
  to). The first (init) call creates it with S = this call's length; later calls write their L
  keys and values at `cache_index` and advance it. Returns the keys and values to attend (the
  whole cache) and the mask made causal by slot: the query in slot index + l sees slots <= it."""
  initialized = module.has_variable("cache", "cached_key")
  cached_key = module.variable("cache", "cached_key", jnp.zeros, k_BLNH.shape, k_BLNH.dtype)
  cached_value = module.variable("cache", "cached_value", jnp.zeros, v_BLNH.shape,
                                 v_BLNH.dtype)
  cache_index = module.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
  index, length = cache_index.value, k_BLNH.shape[1]
  if initialized:
    k_BLNH = jax.lax.dynamic_update_slice(cached_key.value, k_BLNH.astype(
        cached_key.value.dtype), (0, index, 0, 0))
    v_BLNH = jax.lax.dynamic_update_slice(cached_value.value, v_BLNH.astype(
        cached_value.value.dtype), (0, index, 0, 0))
    cached_key.value, cached_value.value = k_BLNH, v_BLNH
    cache_index.value = index + length
  query_slots_L = index + jnp.arange(length)
  causal_LS = jnp.arange(k_BLNH.shape[1])[None, :] <= query_slots_L[:, None]
  return k_BLNH, v_BLNH, AttentionMask(mask.dense_B1LS & causal_LS[None, None])


def choose(config: ModelConfig, platform: str, training: bool = True) -> tuple[str, str]:
  """(implementation, why) for `model.attention="auto"` in programs compiled for `platform`
  ("cpu", "gpu"/"cuda", "tpu"): the platform's fused kernel where it supports the
  configuration, else "xla"."""
  dropout = training and config.attention_dropout > 0
  if config.prefix_length or config.position_embedding in ("alibi", "relative"):
    # Prefix keys are read by every query, outside the fused kernels' causal/segment masks;
    # ALiBi and DeBERTa's c2p/p2c terms are score biases, which they do not take.
    return "xla", "the fused kernels take no prefix keys or score biases"
  if config.family_record.score_bias:
    return "xla", (f"{config.family}'s attention adds a score bias in every layer (T5's "
                   "relative position biases), which the fused kernels do not take")
  if platform == "tpu":
    return (("xla", "the splash kernel has no attention dropout") if dropout
            else ("splash", "TPU, no attention dropout"))
  if platform in ("gpu", "cuda"):
    if dropout:
      return "xla", "cuDNN's fused kernel is used without attention dropout only"
    if config.dtype not in ("bfloat16", "float16"):
      return "xla", "cuDNN's fused kernel takes 16-bit inputs"
    return "cudnn", "GPU, 16-bit compute, no attention dropout"
  return "xla", f"no fused kernel on {platform} (the kernels would run interpreted)"


def resolve(config: ModelConfig, platform: str, training: bool = True) -> ModelConfig:
  """`model.attention="auto"` made concrete for programs compiled for `platform` (`choose`)."""
  if config.attention != "auto":
    return config
  return config.replace(attention=choose(config, platform, training)[0])


# The remat policy of the XLA core in training: save the outputs of exp (the core's only exp
# is the softmax's; a name on its output would not do, since exp's derivative reads the
# unnamed primitive output) and the named row sums; recompute everything else.
_KEEP_SOFTMAX_EXP = jax.checkpoint_policies.save_from_both_policies(
    lambda primitive, *_, **__: primitive is jax.lax.exp_p,
    jax.checkpoint_policies.save_only_these_names("attention_row_sum"))


class XlaAttention(nn.Module):
  """softmax(q kᵀ / sqrt(H) + mask) with dropout, times v, as einsums: the implementation
  whose intermediates are [B, N, L, S]. `divisor`: what the scores are divided by, where it
  is not sqrt(H). `causal_blocks` > 1 (causal self-attention, L = S): the queries in that
  many equal blocks, block i reading only the keys up to its last query, so the score
  blocks above the diagonal are never computed (`causal_query_blocks`)."""

  config: ModelConfig
  deterministic: bool = True
  divisor: float | None = None
  causal_blocks: int = 1

  @nn.compact
  def __call__(self, q_BLNH: Array, k_BSNH: Array, v_BSNH: Array, mask_B1LS: Array,
               score_bias_BNLS: Array | None = None) -> Array:
    dropout = Dropout(self.config.attention_dropout, self.config.dropout_rng)
    if self.causal_blocks == 1:
      return self._core(dropout, q_BLNH, k_BSNH, v_BSNH, mask_B1LS, score_bias_BNLS)
    size = q_BLNH.shape[1] // self.causal_blocks
    outputs = []
    for block in range(self.causal_blocks):
      queries, keys = slice(block * size, (block + 1) * size), slice(0, (block + 1) * size)
      # Each call draws its own dropout key, so the blocks' masks are independent.
      outputs.append(self._core(
          dropout, q_BLNH[:, queries], k_BSNH[:, keys], v_BSNH[:, keys],
          _score_block(mask_B1LS, queries, keys), _score_block(score_bias_BNLS, queries, keys)))
    return jnp.concatenate(outputs, axis=1)

  def _core(self, dropout: Dropout, q_BLNH: Array, k_BSNH: Array, v_BSNH: Array,
            mask_B1LS: Array, score_bias_BNLS: Array | None) -> Array:
    cfg = self.config
    divisor = jnp.sqrt(float(cfg.head_dim)) if self.divisor is None else self.divisor
    # Scores and softmax in fp32 whatever the compute dtype: bf16 softmax loses the
    # small probabilities that carry most of the gradient signal. On a CPU in bf16 the two
    # products and the four of their backward pass read bf16 (the cotangents rounded, as in
    # the layers' products) through precision.einsum's mixed path; left to JAX's derivative,
    # the backward four ran in float32 on float32 cotangents. Rematerialised (see `attend`),
    # the core's re-run forward products feed nothing and XLA drops them.
    scores_BNLS = precision.einsum(cfg, "blnh,bsnh->bnls", q_BLNH, k_BSNH,
                                   out_dtype=jnp.float32) / divisor
    if score_bias_BNLS is not None:
      scores_BNLS = scores_BNLS + score_bias_BNLS
    scores_BNLS = jnp.where(mask_B1LS, scores_BNLS, jnp.finfo(jnp.float32).min)
    # jax.nn.softmax written out, so that what its backward pass reads is what a remat policy
    # keeps: the output of exp (exp's derivative reads it) and the row sums.
    row_max_BNL1 = jax.lax.stop_gradient(scores_BNLS.max(axis=-1, keepdims=True))
    unnormalized_BNLS = jnp.exp(scores_BNLS - row_max_BNL1)
    row_sum_BNL1 = checkpoint_name(unnormalized_BNLS.sum(axis=-1, keepdims=True),
                                   "attention_row_sum")
    probs_BNLS = dropout(unnormalized_BNLS / row_sum_BNL1, deterministic=self.deterministic)
    return checkpoint_name(
        precision.einsum(cfg, "bnls,bsnh->blnh", probs_BNLS, v_BSNH),
        CONTEXT_NAME)


def _score_block(x_BNLS: Array | None, queries: slice, keys: slice) -> Array | None:
  """The [queries, keys] block of a mask or score bias (axes of size 1 broadcast)."""
  if x_BNLS is None:
    return None
  return x_BNLS[:, :, queries if x_BNLS.shape[2] > 1 else slice(None),
                keys if x_BNLS.shape[3] > 1 else slice(None)]


# Causal query blocks: at least 256 queries each (the size measured in whole steps), at most
# 8 blocks (each block is its own ops in every layer, and compile time grows with them).
_CAUSAL_BLOCK_MIN, _CAUSAL_BLOCKS_MAX = 256, 8


def causal_query_blocks(length: int, platform: str) -> int:
  """How many query blocks the XLA core splits causal self-attention of `length` tokens
  into, compiled for `platform`: on CPU the most of at most 8 equal blocks of at least 256
  queries (4 at 1,024 tokens: 37.5% of the score work skipped), else 1. TPU and GPU
  programs are left whole: their fused kernels skip masked blocks themselves, and where
  the XLA core runs there (attention dropout) the split is not measured."""
  if platform != "cpu":
    return 1
  for blocks in range(_CAUSAL_BLOCKS_MAX, 1, -1):
    if length % blocks == 0 and length // blocks >= _CAUSAL_BLOCK_MIN:
      return blocks
  return 1


# The splash kernel's tiles along the sequence are multiples of the TPU's 128 lanes.
_LANES = 128


def _block_size(length: int) -> int:
  """The splash kernel's tile along the sequence: the largest of 512/256/128 dividing the
  (lane-padded) length."""
  return next(block for block in (512, 256, 128) if length % block == 0)


def _splash_per_device(q_BNLH: Array, k_BNSH: Array, v_BNSH: Array,
                       segment_ids_BL: Array | None, *, causal: bool, window: int,
                       interpret: bool) -> Array:
  """The splash kernel on one device's rows and heads (all of the sequence)."""
  # The Pallas TPU kernels load only where splash attention runs.
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
    splash_attention_kernel as splash,
  )
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
    splash_attention_mask as masks,
  )
  _, heads, length, _ = q_BNLH.shape
  shape = (length, k_BNSH.shape[2])
  if window:
    # Keys at most `window` positions away on either side (and none after, when causal).
    mask = masks.LocalMask(shape, window_size=(window, 0 if causal else window), offset=0)
  else:
    mask = masks.CausalMask(shape) if causal else masks.FullMask(shape)
  b = _block_size(length)
  blocks = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                             block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b,
                             block_kv_dq=b)
  # Its residuals (output and row log-sum-exp) carry the name the "dots" remat policy saves,
  # so the backward pass does not run the forward kernel again.
  kernel = splash.make_splash_mha(masks.MultiHeadMask([mask] * heads), head_shards=1,
                                  q_seq_shards=1, block_sizes=blocks, interpret=interpret,
                                  residual_checkpoint_name=CONTEXT_NAME)
  if segment_ids_BL is None:
    return jax.vmap(kernel)(q_BNLH, k_BNSH, v_BNSH)
  segments = splash.SegmentIds(q=segment_ids_BL, kv=segment_ids_BL)
  return jax.vmap(kernel)(q_BNLH, k_BNSH, v_BNSH, segment_ids=segments)


def splash_attention(config: ModelConfig, q_BLNH: Array, k_BSNH: Array, v_BSNH: Array,
                     mask: AttentionMask, window: int = 0) -> Array:
  """The Pallas splash kernel, per device through `shard_map` over the ambient mesh: rows and
  heads stay where the logical rules put them; the sequence must not be sharded. `window` > 0:
  a sliding window of that many keys on either side (the block-sparse mask skips the rest)."""
  interpret = precision.platform() != "tpu"
  q_BNLH = jnp.swapaxes(q_BLNH / jnp.sqrt(float(config.head_dim)).astype(q_BLNH.dtype), 1, 2)
  k_BNSH, v_BNSH = jnp.swapaxes(k_BSNH, 1, 2), jnp.swapaxes(v_BSNH, 1, 2)
  run = functools.partial(_splash_per_device, causal=mask.causal, window=window,
                          interpret=interpret)
  segments = mask.segment_ids_BL
  length = q_BNLH.shape[2]
  pad = -length % _LANES
  if pad:
    # Tiles are whole lanes: pad the sequence with positions of their own segment (-1),
    # which no real query reads, and drop their outputs.
    widths = ((0, 0), (0, 0), (0, pad), (0, 0))
    q_BNLH, k_BNSH, v_BNSH = (jnp.pad(x, widths) for x in (q_BNLH, k_BNSH, v_BNSH))
    if segments is None:
      segments = jnp.ones(q_BNLH.shape[:1] + (length,), jnp.int32)
    segments = jnp.pad(segments, ((0, 0), (0, pad)), constant_values=-1)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    out_BNLH = run(q_BNLH, k_BNSH, v_BNSH, segments)
  else:
    batch, sequence, heads, _ = nn.logical_to_mesh_axes(("batch", "length", "heads", "kv"))
    if sequence is not None:
      raise ValueError("model.attention=splash needs the sequence unsharded (logical axis "
                       f"'length' maps to {sequence!r} in the sharding rules)")
    # An axis that does not divide its dimension (model init traces a batch of 1) stays whole.
    batch, heads = _dividing(batch, q_BNLH.shape[0], mesh), _dividing(heads, q_BNLH.shape[1], mesh)
    spec_BNLH = PartitionSpec(batch, heads, None, None)
    spec_BL = PartitionSpec(batch, None)
    if segments is None:
      sharded = jax.shard_map(lambda q, k, v: run(q, k, v, None), mesh=mesh,
                              in_specs=(spec_BNLH,) * 3, out_specs=spec_BNLH,
                              check_vma=False)
      out_BNLH = sharded(q_BNLH, k_BNSH, v_BNSH)
    else:
      sharded = jax.shard_map(run, mesh=mesh, in_specs=(spec_BNLH,) * 3 + (spec_BL,),
                              out_specs=spec_BNLH, check_vma=False)
      out_BNLH = sharded(q_BNLH, k_BNSH, v_BNSH, segments)
  return jnp.swapaxes(out_BNLH[:, :, :length], 1, 2).astype(precision.activation_dtype(config))


def _dividing(axes: str | tuple[str, ...] | None, size: int,
              mesh: jax.sharding.AbstractMesh) -> str | tuple[str, ...] | None:
  """`axes` where the mesh's ways along them divide `size`, else None (unsharded)."""
  if axes is None:
    return None
  ways = 1
  for axis in (axes,) if isinstance(axes, str) else axes:
    ways *= mesh.shape[axis]
  return axes if size % ways == 0 else None


def window_band(length: int, window: int) -> Array:
  """[1, 1, L, L]: True where query l and key s are at most `window` positions apart (Hugging
  Face's bidirectional sliding-window mask with sliding_window = window)."""
  index = jnp.arange(length)
  return (jnp.abs(index[:, None] - index[None, :]) <= window)[None, None]


def cudnn_attention(config: ModelConfig, q_BLNH: Array, k_BSNH: Array, v_BSNH: Array,
                    mask: AttentionMask, implementation: str = "cudnn", window: int = 0
                    ) -> Array:
  """`jax.nn.dot_product_attention` (cuDNN flash attention on GPU). Causal masking is the
  kernel's own; padding, document segments and a sliding window (`window` keys on either
  side: cuDNN's own window is one-sided, left of the query only) are passed as the boolean
  mask. Tests run the same call with implementation="xla" on CPU, and trace the cuDNN one."""
  causal_only = mask.causal and mask.segment_ids_BL is None and not window
  dense = mask.dense_B1LS
  if window:
    dense = dense & window_band(q_BLNH.shape[1], window)
  # cuDNN takes the mask as a bias of the scores' shape: BERT's padding mask [B, 1, 1, S]
  # broadcast over the queries is refused on the GPU ("Bias must have same seq length as
  # QKV"; XLA's implementation broadcasts it).
  dense = jnp.broadcast_to(dense, (dense.shape[0], 1, q_BLNH.shape[1], k_BSNH.shape[1]))
  dtype = config.compute_dtype
  out_BLNH = jax.nn.dot_product_attention(
      q_BLNH.astype(dtype), k_BSNH.astype(dtype), v_BSNH.astype(dtype),
      mask=None if causal_only else dense, is_causal=mask.causal,
      implementation=implementation)
  return out_BLNH.astype(precision.activation_dtype(config))


def attend(config: ModelConfig, q_BLNH: Array, k_BSNH: Array, v_BSNH: Array,
           mask: AttentionMask, *, deterministic: bool, decode: bool = False,
           local: bool | Array = False, score_bias_BNLS: Array | None = None,
           score_divisor: float | None = None) -> Array:
  """softmax(q kᵀ / sqrt(H) + bias + mask) v with `config.attention`'s implementation;
  generation (`decode`) always takes the XLA path, which reads the KV cache's dense mask.

  `local`: this layer attends within `config.local_window // 2` positions (a bool, or a traced
  one inside a scanned layer stack: the fused kernels then choose by `lax.cond`, the XLA core
  by masking). `score_bias_BNLS` (ALiBi, DeBERTa's c2p/p2c terms) is added to the scores, and
  `score_divisor` replaces sqrt(H) (DeBERTa); only the XLA core takes them.
  """
  implementation = "xla" if decode or config.attention == "auto" else config.attention
  if implementation != "xla" and not deterministic and config.attention_dropout > 0:
    raise ValueError(f"model.attention={implementation} has no attention dropout: set "
                     "model.attention_dropout=0 or model.attention=xla (or auto)")
  if implementation != "xla" and (score_bias_BNLS is not None or score_divisor is not None):
    raise ValueError(f"model.attention={implementation} takes no score bias (ALiBi, DeBERTa's "
                     "relative attention): set model.attention=xla (or auto)")
  window = config.local_window // 2
  if implementation in ("splash", "cudnn"):
    kernel = splash_attention if implementation == "splash" else cudnn_attention
    run = lambda w: kernel(config, q_BLNH, k_BSNH, v_BSNH, mask, window=w)  # noqa: E731
    if not window or local is False:
      return run(0)
    if local is True:
      return run(window)
    return jax.lax.cond(local, lambda: run(window), lambda: run(0))
  if window and local is not False:
    band = window_band(q_BLNH.shape[1], window)
    mask = mask.replace(dense_B1LS=mask.dense_B1LS & (band | jnp.logical_not(local)))
  core = XlaAttention
  if not deterministic and config.attention_dropout > 0 and config.remat_policy == "none":
    # Keep one [B, N, L, S] tensor (exp of the scores) for the backward pass; the
    # probabilities, the dropout mask and the dropped probabilities are recomputed there
    # (elementwise, cheap with the hash mask) instead of being saved per layer, and no
    # matmul is recomputed (docs/performance.md). A block remat policy, where one is set,
    # decides alone what is kept.
    core = nn.remat(XlaAttention, prevent_cse=not config.scan_layers, policy=_KEEP_SOFTMAX_EXP)
  length = q_BLNH.shape[1]
  blocks = (causal_query_blocks(length, precision.platform())
            if mask.causal and k_BSNH.shape[1] == length else 1)
  return core(config, deterministic, score_divisor, blocks, name="core")(
      q_BLNH, k_BSNH, v_BSNH, mask.dense_B1LS, score_bias_BNLS)
