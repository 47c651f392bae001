"""Transformer building blocks shared by BERT and GPT: `Dense`, `Embed`, `SelfAttention`, `Mlp`,
`Adapter`, `Block`, `LayerStack` (cross-layer sharing: bertjax/models/sharing.py).

Parameters carry logical axis names, mapped to mesh axes by the config's rules table; no mesh
appears here. Shape suffixes in names: B batch, L (query) length, S (key) length, D model width,
N heads, H head dim, F MLP width. The parameter-efficient additions sit in the layers they
modify, so that they scan and shard like their weights (LoRA in `Dense`, adapters in `Block`,
key/value prefixes in `SelfAttention`); `bertjax.models.groups.is_added` recognises their names.

The guide: docs/architecture.md, 'Logical axes and the rules table'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import attention, lookup, positions, precision, relative
from bertjax.models.activations import activation_fn
from bertjax.models.config import ModelConfig
from bertjax.models.dropout import Dropout
from bertjax.models.groups import SHARED_LAYER
from bertjax.models.lora import lora_delta, lora_updates

Array = jax.Array
Initializer = Callable[..., Array]

# Activation layouts, constrained at block boundaries.
ACT_BLD = ("batch", "length", "embed")
ACT_BLNH = ("batch", "length", "heads", "kv")
ACT_BLF = ("batch", "length", "mlp")


def kernel_init(config: ModelConfig, std: float | None = None) -> Initializer:
  """BERT uses a truncated normal (google-research/bert); GPT a plain normal (GPT-2): the
  family's `truncated_init`."""
  std = config.initializer_range if std is None else std
  if config.family_record.truncated_init:
    return nn.initializers.truncated_normal(stddev=std)
  return nn.initializers.normal(stddev=std)


def residual_init(config: ModelConfig) -> Initializer:
  """Output projections feeding the residual stream; GPT-2 scales them by 1/sqrt(2L)."""
  std = config.initializer_range
  if config.scale_residual_init:
    std = std / (2 * config.num_layers) ** 0.5
  return kernel_init(config, std)


def constrain(x: Array, axes: tuple[str, ...]) -> Array:
  return nn.with_logical_constraint(x, axes)


class Dense(nn.Module):
  """`y = einsum(equation, x, kernel) + bias` with logically named parameter axes.

  An einsum instead of nn.DenseGeneral keeps head structure explicit ([D, 3, N, H] for a
  fused QKV projection) so tensor parallelism can split heads by name.
  """

  config: ModelConfig
  equation: str
  kernel_shape: tuple[int, ...]
  kernel_axes: tuple[str | None, ...]
  bias_shape: tuple[int, ...] | None
  bias_axes: tuple[str | None, ...] | None = None
  init: Initializer | None = None
  # LoRA updates of this kernel, (target, slice) each (bertjax.models.lora.LORA_SITES); the
  # kernel's input axes must come before its output axes in `equation`.
  lora: tuple[tuple[str, int | None], ...] = ()
  # LoRA's input dropout runs only when False (training).
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    init = self.init or kernel_init(cfg)
    kernel = self.param("kernel", nn.with_logical_partitioning(init, self.kernel_axes),
                        self.kernel_shape, cfg.weight_dtype)
    y = precision.einsum(cfg, self.equation, x, kernel)
    if self.lora:
      delta = lora_delta(self, cfg, x, self.equation, self.kernel_shape, self.kernel_axes,
                         self.lora, self.deterministic)
      y = y + delta.astype(y.dtype)
    if self.bias_shape is not None:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                             self.bias_axes),
                        self.bias_shape, cfg.weight_dtype)
      # The bias's leading axes spelled out: [*batch, *out] + [1.., *out].
      y = y + jnp.expand_dims(bias.astype(y.dtype), tuple(range(y.ndim - bias.ndim)))
    return y


def layer_norm(config: ModelConfig, name: str, axis_name: str = "embed") -> nn.LayerNorm:
  # Statistics and normalisation in float32 whatever the input (flax promotes); the output
  # in the activation dtype (bertjax/models/precision.py).
  # use_fast_variance=False: E[(x-mean)^2] like PyTorch, not E[x^2]-mean^2, so parity holds
  # and bf16 inputs do not cancel catastrophically.
  return nn.LayerNorm(
      epsilon=config.layer_norm_eps, dtype=precision.activation_dtype(config),
      param_dtype=config.weight_dtype, use_fast_variance=False, use_bias=config.norm_bias,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, (axis_name,)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axis_name,)),
      name=name)


class Embed(nn.Module):
  """A lookup table `embedding` [num_embeddings, hidden_size] that is also the tied output
  projection (`attend`); parameters and numerics are those of nn.Embed.

  Lookups read the table with its feature axis whole. Left to propagation, the gather from a
  table laid out [vocab: tensor, embed: fsdp] with ids laid out [batch: (data, fsdp)] yields
  rows sharded on embed over fsdp, and no collective turns that into the activations' batch
  sharding over the same fsdp axis: XLA replicates the whole [B, L, D] tensor and
  re-partitions it ("Involuntary full rematerialization"), in the forward gather and in the
  backward pass's scatter-add alike; pinning the output's layout alone does not
  help. With the feature axis gathered first (the all-gather FSDP does for every weight it
  uses) each device reads, for its own batch rows, the rows in its own vocab shard, and one
  all-reduce over the tensor axis completes them: Megatron's vocabulary-parallel embedding.
  Position and token-type tables (rows unsharded) are looked up with [B, L] ids too and need
  the same.

  How the rows are read (bertjax/models/lookup.py): a gather whose gradient is summed in
  float32 (`take_rows`); for a table of at most `lookup.SELECT_ROWS` rows (token types),
  elementwise selects from the float32 table (`select_rows`: its gather's scatter-add gradient
  was the largest kernel of BERT-large's step on an H200); with `config.embed_lookup="one_hot"`
  a matmul (T5X, MaxText).
  """

  config: ModelConfig
  num_embeddings: int
  # Logical axes of the table: (row axis, "embed").
  axes: tuple[str | None, str]
  # Logical axes the lookup's output is pinned to (the word tables: ACT_BLD, the layout every
  # layer expects), or None where ids may broadcast (positions [1, L]), which a batch
  # constraint would not fit.
  output_axes: tuple[str, ...] | None = None
  # The rows' width; 0: hidden_size (ELECTRA's and DeBERTa's tables may be narrower).
  width: int = 0
  # A table this one is added to under stop-gradient (DeBERTa-v3's gradient-disentangled
  # embedding sharing: the discriminator's table is the generator's plus its own residual,
  # which then starts at zero); None: the table is this module's own.
  base: Embed | None = None

  def setup(self) -> None:
    cfg = self.config
    init = nn.initializers.zeros if self.base is not None else kernel_init(cfg)
    self.embedding = self.param(
        "embedding", nn.with_logical_partitioning(init, self.axes),
        (self.num_embeddings, self.width or cfg.hidden_size), cfg.weight_dtype)

  def table(self) -> Array:
    """The rows as read: the own table, or the residual plus the base's under stop-gradient."""
    if self.base is None:
      return self.embedding
    return jax.lax.stop_gradient(self.base.embedding) + self.embedding

  def __call__(self, ids: Array) -> Array:
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"embedding lookup needs integer ids, got {ids.dtype}")
    dtype = precision.activation_dtype(self.config)
    small = self.num_embeddings <= lookup.SELECT_ROWS
    # A small table is read in its own dtype (float32: its gradient summed exactly); a large
    # one in the activation dtype, the form FSDP all-gathers.
    table = self.table() if small else self.table().astype(dtype)
    if self.num_embeddings == 1:
      return jnp.broadcast_to(table.astype(dtype), ids.shape + (table.shape[-1],))
    # Rows keep their sharding, features are gathered: see the class docstring.
    table = constrain(table, (self.axes[0], None))
    if self.config.embed_lookup == "one_hot":
      out = lookup.one_hot_rows(table, ids)
    elif small:
      out = lookup.select_rows(table, ids)
    else:
      out = lookup.take_rows(table, ids)
    out = out.astype(dtype)
    if self.output_axes is not None:
      out = constrain(out, self.output_axes)
    return out

  def attend(self, x: Array) -> Array:
    """x @ embeddingᵀ under the precision policy."""
    rows = "abc"[:x.ndim - 1]
    return precision.einsum(self.config, f"{rows}d,vd->{rows}v", x, self.table())


def embed(config: ModelConfig, num: int, axes: tuple[str | None, str], name: str,
          output_axes: tuple[str, ...] | None = None, width: int = 0,
          base: Embed | None = None) -> Embed:
  return Embed(config, num, axes, output_axes, width, base, name=name)


def tied_logits(config: ModelConfig, embedding: Embed, x_BLD: Array) -> Array:
  """x @ embeddingᵀ: the output projection tied to the input embedding (BERT's MLM decoder,
  GPT's LM head).

  The input's layout is pinned first. Left free, XLA (jax 0.10, Shardy) picks a partitioning
  on a (2, 2, 2) data/fsdp/tensor mesh whose backward pass is wrong — gradients off by up to
  50% while the loss is right (tests/test_train_sharding.py compares gradient norms).
  """
  x_BLD = constrain(x_BLD, ACT_BLD)
  return embedding.attend(x_BLD)


class SelfAttention(nn.Module):
  """Multi-head self-attention with a fused QKV projection; the core is
  `config.attention`'s implementation (bertjax/models/attention.py).

  `decode=True` (generation) keeps a key/value cache in the "cache" collection (apply with
  `mutable=["cache"]`): `cached_key`/`cached_value` [B, S, N, H] and `cache_index`, the slot
  the next token is written to. The first (init) call creates the cache with S = the input's
  length; later calls write their L keys at `cache_index`, attend causally by slot over the
  whole cache, and advance the index by L. `mask.dense_B1LS` then masks cache slots (key
  padding), [B, 1, 1, S] or [B, 1, L, S].

  `config.prefix_length` P > 0 (prefix tuning): learned `prefix_key`/`prefix_value` [P, N, H]
  go before the keys and values (after the cache, which holds tokens only) and every query
  reads them: the mask gains P leading True columns.
  """

  config: ModelConfig
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x_BLD: Array, mask: attention.AttentionMask,
               positions_BL: Array | None = None, local: bool | Array = False,
               relative_positions: relative.RelativePositions | None = None) -> Array:
    """`positions_BL`: each token's position in its document (rotary and ALiBi); `local`:
    whether this layer attends within the sliding window (a traced bool under nn.scan);
    `relative_positions`: the encoder's table and rows (DeBERTa)."""
    cfg = self.config
    d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    bias = cfg.attention_bias
    qkv = Dense(cfg, "bld,dtnh->bltnh", (d, 3, n, h), ("embed", "qkv", "heads", "kv"),
                (3, n, h) if bias else None, ("qkv", "heads", "kv"),
                lora=lora_updates(cfg, ("attention", "qkv")),
                deterministic=self.deterministic, name="qkv")
    qkv_BL3NH = qkv(x_BLD)
    q_BLNH, k_BSNH, v_BSNH = (qkv_BL3NH[:, :, i] for i in range(3))
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(x_BLD.shape[1]), x_BLD.shape[:2])
    if cfg.position_embedding == "rotary":
      inv_freq_K = jnp.asarray(positions.rotary_frequencies(cfg, cfg.rope_theta))
      if cfg.local_window:
        local_K = jnp.asarray(positions.rotary_frequencies(
            cfg, cfg.local_rope_theta or cfg.rope_theta))
        inv_freq_K = jnp.where(local, local_K, inv_freq_K)
      q_BLNH = positions.apply_rotary(q_BLNH, positions_BL, inv_freq_K)
      k_BSNH = positions.apply_rotary(k_BSNH, positions_BL, inv_freq_K)
    q_BLNH = constrain(q_BLNH, ACT_BLNH)
    if self.decode:
      k_BSNH, v_BSNH, mask = attention.kv_cache(self, k_BSNH, v_BSNH, mask)
    if cfg.prefix_length:
      k_BSNH, v_BSNH, mask = self._prepend_prefix(k_BSNH, v_BSNH, mask)
    score_bias, divisor = None, None
    if cfg.position_embedding == "alibi":
      score_bias = positions.alibi_bias(cfg, positions_BL)
    elif cfg.position_embedding == "relative":
      score_bias = self._disentangled_bias(qkv, q_BLNH, k_BSNH, relative_positions)
      divisor = relative.score_divisor(cfg)
    out_BLNH = attention.attend(cfg, q_BLNH, k_BSNH, v_BSNH, mask,
                                deterministic=self.deterministic, decode=self.decode,
                                local=local, score_bias_BNLS=score_bias,
                                score_divisor=divisor)
    out_BLNH = constrain(out_BLNH, ACT_BLNH)
    return Dense(cfg, "blnh,nhd->bld", (n, h, d), ("heads", "kv", "embed"),
                 (d,) if bias else None, ("embed",),
                 init=residual_init(cfg), lora=lora_updates(cfg, ("attention", "out")),
                 deterministic=self.deterministic, name="out")(out_BLNH)

  def _disentangled_bias(self, qkv: Dense, q_BLNH: Array, k_BSNH: Array,
                         rel: relative.RelativePositions | None) -> Array:
    """DeBERTa's c2p and p2c terms: the encoder's table through dropout (transformers'
    pos_dropout, per layer), projected to position queries and keys by the content projections
    (`share_attention_key`, LoRA included, as peft on transformers' query_proj/key_proj) or by
    `pos_query_proj` / `pos_key_proj`, each only where its term is on."""
    cfg = self.config
    if rel is None or cfg.prefix_length or self.decode:
      raise ValueError("model.position_embedding=relative needs the encoder's relative positions "
                       "and takes no prefixes (model.prefix_length) or KV cache")
    d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    rel_1RD = Dropout(cfg.hidden_dropout, cfg.dropout_rng, name="pos_dropout")(
        rel.embeddings_RD[None], deterministic=self.deterministic)
    terms = relative.terms(cfg)
    if cfg.share_attention_key:
      pos_R3NH = qkv(rel_1RD)[0]
      pos_RNH = {"p2c": pos_R3NH[:, 0], "c2p": pos_R3NH[:, 1]}
    else:
      names = {"p2c": "pos_query_proj", "c2p": "pos_key_proj"}
      pos_RNH = {t: Dense(cfg, "brd,dnh->brnh", (d, n, h), ("embed", "heads", "kv"),
                          (n, h) if cfg.attention_bias else None, ("heads", "kv"),
                          name=names[t])(rel_1RD)[0] for t in terms}
    pos_RNH = {t: x for t, x in pos_RNH.items() if t in terms}
    return relative.disentangled_scores(cfg, q_BLNH, k_BSNH, pos_RNH.get("p2c"),
                                        pos_RNH.get("c2p"), rel.index_B1LS)

  def _prepend_prefix(self, k_BSNH: Array, v_BSNH: Array, mask: attention.AttentionMask
                      ) -> tuple[Array, Array, attention.AttentionMask]:
    """Keys and values with the P learned prefix positions in front, and the dense mask with
    P always-readable columns. The structured mask (segments, causal flag) is dropped: only
    the XLA core, which reads the dense one, runs with prefixes (ModelConfig refuses the
    fused kernels)."""
    cfg = self.config
    p, n, h = cfg.prefix_length, cfg.num_heads, cfg.head_dim
    axes = (None, "heads", "kv")
    out = []
    for name, x_BSNH in (("prefix_key", k_BSNH), ("prefix_value", v_BSNH)):
      prefix_PNH = self.param(name, nn.with_logical_partitioning(kernel_init(cfg), axes),
                              (p, n, h), cfg.weight_dtype)
      prefix_BPNH = jnp.broadcast_to(prefix_PNH.astype(x_BSNH.dtype)[None],
                                     (x_BSNH.shape[0], p, n, h))
      out.append(jnp.concatenate([prefix_BPNH, x_BSNH], axis=1))
    dense = mask.dense_B1LS
    visible = jnp.ones(dense.shape[:3] + (p,), bool)
    return out[0], out[1], attention.AttentionMask(jnp.concatenate([visible, dense], axis=-1))


class Mlp(nn.Module):
  config: ModelConfig
  # LoRA's input dropout and the hidden activations' (`hidden_dropout`) read it; the block
  # applies the residual dropout.
  deterministic: bool = True
  # Dropout on the hidden activations (the encoder-decoders' activation_dropout); 0: none.
  hidden_dropout: float = 0.0
  # Initialisers where they are not kernel_init's and residual_init's (T5's fan-in scaled).
  wi_init: Initializer | None = None
  wo_init: Initializer | None = None

  @nn.compact
  def __call__(self, x_BLD: Array) -> Array:
    cfg = self.config
    d, f = cfg.hidden_size, cfg.mlp_dim
    bias = cfg.mlp_bias
    lora = lora_updates(cfg, ("mlp", "wi"))
    act = activation_fn(cfg.activation)
    if cfg.mlp_gated:
      # [D, 2, F]: the activated half and the gate (Hugging Face's Wi rows, chunked in two).
      h_BL2F = Dense(cfg, "bld,dgf->blgf", (d, 2, f), ("embed", None, "mlp"),
                     (2, f) if bias else None, (None, "mlp"), init=self.wi_init, lora=lora,
                     deterministic=self.deterministic, name="wi")(x_BLD)
      h_BLF = act(h_BL2F[:, :, 0]) * h_BL2F[:, :, 1]
    else:
      h_BLF = act(Dense(cfg, "bld,df->blf", (d, f), ("embed", "mlp"), (f,) if bias else None,
                        ("mlp",), init=self.wi_init, lora=lora,
                        deterministic=self.deterministic, name="wi")(x_BLD))
    h_BLF = constrain(h_BLF, ACT_BLF)
    if self.hidden_dropout:
      h_BLF = Dropout(self.hidden_dropout, cfg.dropout_rng)(h_BLF,
                                                            deterministic=self.deterministic)
    return Dense(cfg, "blf,fd->bld", (f, d), ("mlp", "embed"), (d,) if bias else None,
                 ("embed",),
                 init=self.wo_init or residual_init(cfg), lora=lora_updates(cfg, ("mlp", "wo")),
                 deterministic=self.deterministic, name="wo")(h_BLF)


class Adapter(nn.Module):
  """A Houlsby et al. (2019) bottleneck adapter, x + up(act(down(x))): D -> adapter_size ->
  D with the model's activation. `up` starts at zero, so a fresh adapter is the identity."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: Array) -> Array:
    cfg = self.config
    d, a = cfg.hidden_size, cfg.adapter_size
    h_BLA = Dense(cfg, "bld,da->bla", (d, a), ("embed", None), (a,), (None,),
                  name="down")(x_BLD)
    h_BLA = activation_fn(cfg.activation)(h_BLA)
    up_BLD = Dense(cfg, "bla,ad->bld", (a, d), (None, "embed"), (d,), ("embed",),
                   init=nn.initializers.zeros, name="up")(h_BLA)
    return x_BLD + up_BLD


class Block(nn.Module):
  """One transformer layer, post-LN (BERT, GPT-1) or pre-LN (GPT-2).

  Returns `(x, None)` so that the same class runs unrolled or under nn.scan.
  """

  config: ModelConfig
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x_BLD: Array, mask: attention.AttentionMask,
               positions_BL: Array | None = None, layer: int | Array = 0,
               relative_positions: relative.RelativePositions | None = None
               ) -> tuple[Array, None]:
    """`layer`: this block's index (traced under nn.scan), for per-layer patterns;
    `relative_positions`: the encoder's, shared by every layer (DeBERTa)."""
    cfg = self.config
    dropout = functools.partial(Dropout(cfg.hidden_dropout, cfg.dropout_rng),
                                deterministic=self.deterministic)
    self_attention = SelfAttention(cfg, self.deterministic, self.decode, name="attention")
    mlp = Mlp(cfg, self.deterministic, name="mlp")
    attention_norm = layer_norm(cfg, "attention_norm")
    mlp_norm = layer_norm(cfg, "mlp_norm")
    local = cfg.is_local(layer)
    self_attention = functools.partial(self_attention, positions_BL=positions_BL, local=local,
                                       relative_positions=relative_positions)
    if not cfg.first_attention_norm:
      # ModernBERT's layer 0 reads the (normalised) embeddings as they are.
      norm = attention_norm
      attention_norm = lambda x: jnp.where(layer == 0, x, norm(x))  # noqa: E731
    if cfg.adapter_size:
      # Houlsby's placement: on each sub-block's output, before dropout and the residual add.
      attention_adapter = Adapter(cfg, name="adapter_attention")
      mlp_adapter = Adapter(cfg, name="adapter_mlp")
      attention = lambda x, m: attention_adapter(self_attention(x, m))  # noqa: E731
      mlp_block = lambda x: mlp_adapter(mlp(x))  # noqa: E731
    else:
      attention, mlp_block = self_attention, mlp
    if cfg.norm_position == "post":
      x_BLD = attention_norm(x_BLD + dropout(attention(x_BLD, mask)))
      x_BLD = mlp_norm(x_BLD + dropout(mlp_block(x_BLD)))
    else:
      x_BLD = x_BLD + dropout(attention(attention_norm(x_BLD), mask))
      x_BLD = x_BLD + dropout(mlp_block(mlp_norm(x_BLD)))
    return constrain(x_BLD, ACT_BLD), None


REMAT_POLICIES: dict[str, Any] = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    # Every matmul's output (with the XLA attention core that includes its [B, N, L, S]
    # scores: recomputing them instead crashes libtpu 0.0.42 in bf16, as do "full" and
    # "dots_no_batch"), and the splash kernel's named residuals, so that its forward pass
    # is not run again in the backward one.
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots,
        jax.checkpoint_policies.save_only_these_names(attention.CONTEXT_NAME)),
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class LayerStack(nn.Module):
  """`num_layers` blocks, scanned (one compiled body, flat compile time) or unrolled; with
  `layer_sharing="all"` one Block, `shared_layer`, for all (partly: models/sharing.py)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: Array, mask: attention.AttentionMask, deterministic: bool = True,
               decode: bool = False, positions_BL: Array | None = None) -> Array:
    """`decode=True`: attention reads and writes the "cache" collection (generation);
    `positions_BL`: each token's position in its document (rotary, ALiBi, relative)."""
    cfg = self.config
    rel = (self._relative_positions(x_BLD.shape[1], positions_BL)
           if cfg.position_embedding == "relative" else None)
    block = Block
    if cfg.remat_policy != "none":
      block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat_policy],
                       prevent_cse=not cfg.scan_layers)
    shared = cfg.layer_sharing == "all"
    if cfg.scan_layers:
      # The KV cache scans like the parameters (a slice per layer); the relative positions and
      # shared parameters are broadcast (a loop constant: the scan's transpose sums its grads).
      stack = nn.scan(block, variable_axes={"cache": 0} if shared else {"params": 0, "cache": 0},
                      variable_broadcast="params" if shared else False,
                      split_rngs={"params": not shared, "dropout": True},
                      in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast),
                      length=cfg.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
      x_BLD, _ = stack(cfg, deterministic, decode, name=SHARED_LAYER if shared else "layers")(
          x_BLD, mask, positions_BL, jnp.arange(cfg.num_layers), rel)
      return x_BLD
    one = block(cfg, deterministic, decode, name=SHARED_LAYER) if shared else None
    for i in range(cfg.num_layers):
      layer = one or block(cfg, deterministic, decode, name=f"layers_{i}")
      x_BLD, _ = layer(x_BLD, mask, positions_BL, i, rel)
    return x_BLD

  def _relative_positions(self, length: int, positions_BL: Array | None
                          ) -> relative.RelativePositions:
    """DeBERTa's relative position table (transformers' encoder.rel_embeddings) and its
    LayerNorm (encoder.LayerNorm), once for all layers, with the row each query-key pair
    reads."""
    cfg = self.config
    table_RD = embed(cfg, 2 * relative.span(cfg), (None, "embed"), "rel_embeddings").table()
    if cfg.relative_embedding_norm:
      table_RD = layer_norm(cfg, "rel_embeddings_norm")(table_RD)
    return relative.RelativePositions(table_RD.astype(precision.activation_dtype(cfg)),
                                      relative.relative_index(cfg, length, positions_BL))
