"""The typed model configuration shared by BERT and GPT.

Config files (ml_collections) hold a `model` group; it becomes a frozen `ModelConfig` at
the model boundary so that model code reads typed fields, not dictionary keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from bertjax.models import checks, families
from bertjax.models.options import (
  Activation,
  Architecture,
  Attention,
  DropoutRng,
  EmbeddingSharing,
  EmbedLookup,
  LayerSharing,
  MatmulOutput,
  NormPosition,
  PositionEmbedding,
  RematPolicy,
)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# A setting chosen per backend when a run starts (bertjax/training/defaults.py).
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a BERT encoder, a GPT decoder or a T5 encoder-decoder."""

  # A registered family (bertjax/models/families.py): "bert" (bidirectional encoder, MLM/NSP
  # heads), "gpt" (causal decoder, tied LM head), "t5" (encoder-decoder: RMS norms, bucketed
  # relative position biases, no biases) or "bart" (encoder-decoder: learned positions, post-LN,
  # biases).
  family: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  # Width of the MLP's hidden layer (4 * hidden_size in the BERT and GPT papers).
  mlp_dim: int
  # Size of the learned position table; the longest sequence the model accepts.
  max_positions: int
  # Segment (token type) vocabulary of BERT; 0 for GPT.
  type_vocab_size: int = 2
  # "post": LayerNorm after each residual add (BERT, GPT-1); "pre": before each sub-block
  # with a final LayerNorm (GPT-2, Cramming BERT).
  norm_position: NormPosition = "post"
  activation: Activation = "gelu"
  layer_norm_eps: float = 1e-12
  # Dropout on embeddings and on every residual branch.
  hidden_dropout: float = 0.1
  # Dropout on attention probabilities.
  attention_dropout: float = 0.1
  # Where dropout's random bits come from: "hash" (a counter hash of each element's index,
  # a few integer ops per element; bertjax/models/dropout.py) or "threefry"
  # (jax.random.bernoulli, following jax_default_prng_impl).
  dropout_rng: DropoutRng = "hash"
  # How embedding tables are read: "gather" (a row gather, as flax.linen.Embed) or "one_hot"
  # (one-hot ids times the table, T5X's `one_hot` / MaxText's `use_iota_embed`: a matmul that
  # SPMD partitions like any other, offered for TPUs, where a gather can be the slower op; it
  # costs a [B, L, V] operand and an all-positions LM head's FLOPs). The same rows either way.
  embed_lookup: EmbedLookup = "gather"
  # The attention core's implementation (bertjax/models/attention.py): "xla" (einsums, any
  # device, attention dropout), "splash" (Pallas TPU flash kernel), "cudnn" (cuDNN flash
  # attention on GPU), or "auto": the compiled-for platform's fused kernel where it supports
  # the configuration (the kernels have no attention dropout), else "xla".
  attention: Attention = "auto"
  # Standard deviation of the (truncated) normal initialiser.
  initializer_range: float = 0.02
  # GPT-2: residual output projections initialised with std / sqrt(2 * num_layers).
  scale_residual_init: bool = False
  # Whether a pre-LN model ends with a final LayerNorm (GPT-2: yes).
  final_layer_norm: bool = True
  # Compute dtype: what matmuls and einsums read ("bfloat16" for mixed precision); layer
  # norms, softmax and losses stay float32 (bertjax/models/precision.py). "auto": made
  # concrete when a run starts, per backend (bertjax/training/defaults.py).
  dtype: str = "float32"
  # Dtype of the stored parameters (float32 master weights under mixed precision).
  param_dtype: str = "float32"
  # What matmuls write: "compute" (the compute dtype: TPU, GPU), "float32" (the float32
  # accumulator: the fast bf16 path of XLA's CPU backend), or "auto" (per platform).
  matmul_output: MatmulOutput = "auto"
  # GPT: sequence positions per chunk of the LM head and its loss (bertjax/training/objectives.py's
  # chunked_lm_loss): the [B, L, V] logits are never materialised. 0: the whole logits at
  # once. Must divide the sequence length.
  loss_chunk: int = 0
  # Activation checkpointing of each block: what the backward pass may keep.
  remat_policy: RematPolicy = "none"
  # Stack layers with nn.scan: compile time stays flat in depth.
  scan_layers: bool = True
  # Number of labels of a sequence-classification head (fine-tuning).
  num_labels: int = 2
  # Parameter-efficient fine-tuning (bertjax/models/peft.py; train only the additions with
  # optimizer.freeze=base). All off by default: the parameter tree is then unchanged.
  # LoRA (Hu et al. 2021): the rank r of a low-rank update W + (lora_alpha / r)·A·B of every
  # targeted projection; B starts at zero, so a fresh update changes nothing. 0: off.
  lora_rank: int = 0
  # The update's scale is lora_alpha / lora_rank (peft's LoraConfig: lora_alpha 8, no
  # rank-stabilised scaling).
  lora_alpha: float = 8.0
  # Dropout on a targeted projection's input on the LoRA path only (peft's lora_dropout).
  lora_dropout: float = 0.0
  # Comma-separated projections LoRA updates. BERT: query, key, value (the three slices of the
  # fused qkv kernel, one update each, as Hugging Face's separate Linear layers), out (the
  # attention output), wi, wo (the MLP). GPT: qkv (the fused kernel, GPT-2's one c_attn), out,
  # wi, wo. "": peft's default for the family (BERT query,value; GPT qkv).
  lora_targets: str = ""
  # Houlsby et al. (2019) bottleneck adapters: width of the down/up projection added after the
  # attention output and the MLP output of every layer (the up-projection starts at zero: a
  # fresh adapter is the identity). 0: off.
  adapter_size: int = 0
  # Prefix tuning (Li & Liang 2021): learned key/value positions per layer, prepended to every
  # layer's keys and values and attended by every query (no causal or padding mask on them);
  # they take no token positions. Needs the XLA attention core. 0: off.
  prefix_length: int = 0
  # --- Modern encoder options (BERT family; MosaicBERT, ModernBERT; docs/models.md) ---------
  # How positions enter: "learned" (a table of max_positions rows added to the embeddings:
  # BERT, GPT), "rotary" (RoPE on queries and keys, Su et al. 2021, the rotate-half layout of
  # Hugging Face: ModernBERT) or "alibi" (a per-head linear penalty on the query-key distance,
  # Press et al. 2022, symmetric for an encoder: MosaicBERT). Positions restart in every
  # packed document.
  position_embedding: PositionEmbedding = "learned"
  # RoPE base of the global-attention layers (ModernBERT 160,000).
  rope_theta: float = 10_000.0
  # RoPE base of the sliding-window layers (ModernBERT 10,000); 0: rope_theta.
  local_rope_theta: float = 0.0
  # Gated MLP (GLU, Shazeer 2020): `wi` projects to 2 x mlp_dim, the first half through the
  # activation times the second half (GeGLU with gelu, SwiGLU with silu).
  mlp_gated: bool = False
  # Biases of the attention projections (qkv, out); ModernBERT has none.
  attention_bias: bool = True
  # Biases of the MLP projections (wi, wo).
  mlp_bias: bool = True
  # Biases (shifts) of every LayerNorm.
  norm_bias: bool = True
  # Bias of the MLM head's dense transform (ModernBERT: none; the decoder bias stays).
  head_bias: bool = True
  # BERT's tanh pooler on [CLS]; without it the pooled output is [CLS]'s final hidden state
  # (ModernBERT's "cls" pooling) and a classification head adds a dense+act+norm before the
  # classifier, as Hugging Face's ModernBertForSequenceClassification.
  pooler: bool = True
  # Sliding-window attention: a local layer's query reads keys at most local_window // 2
  # positions away on either side (ModernBERT's local_attention 128). 0: every layer global.
  local_window: int = 0
  # With local_window: layers 0, n, 2n, ... attend globally, the others locally (ModernBERT 3).
  global_every: int = 1
  # Whether layer 0 normalises its attention input; ModernBERT's does not (its embeddings were
  # just normalised). Layer 0 still holds the (unused) scale so that scanned layers match.
  first_attention_norm: bool = True
  # --- ELECTRA, DeBERTa and replaced-token detection (docs/models.md) ------------------------
  # The layout of embeddings and heads: "bert" (BERT, RoBERTa; ModernBERT by the options
  # above), "electra" (no pooler; the embeddings normalised at embedding_size, then projected
  # to hidden_size with a bias; ELECTRA's discriminator, generator and classification heads),
  # "deberta" (DeBERTa-v2/v3: position_embedding="relative"; the embeddings projected without
  # a bias, then normalised and zeroed at padding; no pooler), "albert" (ELECTRA's embeddings,
  # projected with a bias whatever the widths, as transformers' embedding_hidden_mapping_in;
  # BERT's tanh pooler; an MLM head that projects to embedding_size before the tied decoder).
  architecture: Architecture = "bert"
  # Width of the embedding tables, where it differs from hidden_size (ELECTRA-Small 128 under
  # a hidden size of 256, ALBERT 128 under any); 0: hidden_size.
  embedding_size: int = 0
  # With position_embedding="relative" (DeBERTa's disentangled attention, He et al. 2021):
  # the position terms added to content-to-content scores: "c2p|p2c", "c2p" or "p2c".
  relative_attention_terms: str = "c2p|p2c"
  # Relative distances bucketed logarithmically beyond position_buckets / 2 (DeBERTa-v3: 256);
  # 0: no buckets, distances clipped at max_relative_positions.
  position_buckets: int = 256
  # The farthest relative distance told apart; 0: max_positions (transformers' -1).
  max_relative_positions: int = 0
  # Position keys and queries projected by the content projections (DeBERTa-v2/v3 share_att_key)
  # instead of their own.
  share_attention_key: bool = True
  # A LayerNorm on the relative position table (DeBERTa-v2/v3 norm_rel_ebd="layer_norm").
  relative_embedding_norm: bool = True
  # Replaced-token detection (ELECTRA, Clark et al. 2020; DeBERTa-v3, He et al. 2023): the width
  # of the generator, a small MLM encoder trained with this model (the discriminator); 0: none.
  generator_hidden_size: int = 0
  # The generator's depth (DeBERTa-v3: half the discriminator's); 0: num_layers.
  generator_num_layers: int = 0
  # The generator's attention heads (ELECTRA: the discriminator's times the size fraction).
  generator_num_heads: int = 0
  # The generator's MLP width; 0: 4 x generator_hidden_size.
  generator_mlp_dim: int = 0
  # How generator and discriminator share embeddings: "shared" (ELECTRA: one set of tables,
  # trained by both losses) or "gdes" (DeBERTa-v3's gradient-disentangled sharing: the
  # discriminator's word table is the generator's, under stop-gradient, plus its own residual).
  embedding_sharing: EmbeddingSharing = "shared"
  # --- ALBERT (docs/models.md) ----------------------------------------------------------------
  # Cross-layer parameter sharing (Lan et al. 2020, Section 3.1 and Table 4): "none"; "all"
  # (one layer's parameters, `encoder/shared_layer`, used by every layer: ALBERT); "attention"
  # (the attention projections and their LayerNorm shared, the FFN per layer) or "ffn" (the
  # FFN and its LayerNorm shared, the attention per layer). BERT family.
  layer_sharing: LayerSharing = "none"
  # --- SpanBERT (docs/models.md) ----------------------------------------------------------------
  # The span-boundary head (Joshi et al. 2020, Section 3.2; bertjax.models.spanbert): rows of
  # its relative-position table, the deepest offset in a span it predicts (SpanBERT: 10);
  # 0: no span-boundary head. Objective mlm_sbo.
  span_boundary_positions: int = 0
  # --- T5 (Raffel et al. 2020; bertjax/models/t5.py, docs/models.md) -------------------------
  # Width of each attention head where it is not hidden_size / num_heads (T5's d_kv: 128 under
  # a model width of 1,024 in T5-3B and T5-11B); 0: hidden_size / num_heads.
  head_size: int = 0
  # Depth of an encoder-decoder's decoder; 0: num_layers (the encoder's depth).
  decoder_layers: int = 0
  # T5's relative position bias: distances in this many buckets (half each way in the encoder),
  # exact below half of them, logarithmic up to the max distance (T5: 32 and 128).
  relative_attention_buckets: int = 32
  relative_attention_max_distance: int = 128
  # T5 1.0 multiplies the decoder's output by hidden_size ** -0.5 before the tied LM head; T5
  # 1.1 does not (transformers 5: scale_decoder_outputs, from the config's tie_word_embeddings).
  scale_decoder_outputs: bool = True
  # Dropout on an encoder-decoder's MLP hidden activations (BART's activation_dropout; T5's
  # one rate).
  activation_dropout: float = 0.0
  # BART: token embeddings times sqrt(hidden_size) (scale_embedding; BART base/large: no).
  scale_embeddings: bool = False

  def __post_init__(self) -> None:
    for name, allowed in (("dtype", [*_DTYPES, AUTO]), ("param_dtype", list(_DTYPES))):
      if getattr(self, name) not in allowed:
        raise ValueError(f"model.{name} must be one of {sorted(allowed)}, got "
                         f"{getattr(self, name)!r}")
    checks.check(self)

  @property
  def family_record(self) -> families.Family:
    """The registry's record of this model's family (bertjax/models/families.py)."""
    return families.get(self.family)

  @property
  def is_encoder_decoder(self) -> bool:
    return self.family_record.is_encoder_decoder

  @property
  def is_decoder(self) -> bool:
    """A causal decoder (GPT): generates by continuing its input."""
    return self.family_record.is_decoder

  @property
  def is_encoder(self) -> bool:
    """A bidirectional encoder (BERT and its kin): fills masks, carries task heads."""
    return self.family_record.is_encoder

  @property
  def decoder_depth(self) -> int:
    """An encoder-decoder's decoder layers (decoder_layers, or num_layers where it is 0)."""
    return self.decoder_layers or self.num_layers

  @property
  def projects_embeddings(self) -> bool:
    """Whether the embedding output is projected to the hidden size: ALBERT's always (its
    embedding_hidden_mapping_in), ELECTRA's and DeBERTa's where the widths differ."""
    return self.architecture == "albert" or self.embedding_width != self.hidden_size

  @property
  def embedding_width(self) -> int:
    """The embedding tables' width: embedding_size, or hidden_size where it is 0."""
    return self.embedding_size or self.hidden_size

  @property
  def has_generator(self) -> bool:
    return bool(self.generator_hidden_size)

  def discriminator_config(self) -> ModelConfig:
    """This model without its generator: the discriminator alone (what fine-tunes and exports)."""
    return self.replace(generator_hidden_size=0, generator_num_layers=0, generator_num_heads=0,
                        generator_mlp_dim=0)

  def generator_config(self) -> ModelConfig:
    """The generator's config: this model's with the generator's shape, the same embedding
    width (the tables are shared), and no generator of its own."""
    if not self.generator_hidden_size:
      raise ValueError("this model has no generator (model.generator_hidden_size is 0)")
    width = self.generator_hidden_size
    return self.replace(
        hidden_size=width, num_layers=self.generator_num_layers or self.num_layers,
        num_heads=self.generator_num_heads or self.num_heads,
        mlp_dim=self.generator_mlp_dim or 4 * width,
        embedding_size=self.embedding_width if self.embedding_width != width else 0,
        generator_hidden_size=0, generator_num_layers=0, generator_num_heads=0,
        generator_mlp_dim=0)

  def is_local(self, layer: Any) -> Any:
    """Whether layer `layer` attends within the sliding window (a traced bool for a traced
    layer index, inside a scanned layer stack)."""
    return bool(self.local_window) and layer % self.global_every != 0

  @property
  def lora_modules(self) -> tuple[str, ...]:
    """The projections LoRA updates (`lora_targets` resolved); () when LoRA is off."""
    return checks.lora_modules(self)

  @property
  def lora_scale(self) -> float:
    """alpha / r: what A·B is multiplied by."""
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  @property
  def peft(self) -> bool:
    """Whether any parameter-efficient addition (LoRA, adapters, prefixes) is on."""
    return bool(self.lora_rank or self.adapter_size or self.prefix_length)

  @property
  def head_dim(self) -> int:
    return self.head_size or self.hidden_size // self.num_heads

  @property
  def compute_dtype(self) -> Any:
    if self.dtype == AUTO:
      raise ValueError("model.dtype='auto' is made concrete when a run starts, for the backend "
                       "it computes on (bertjax.training.defaults.resolve); this model config "
                       "was not resolved")
    return _DTYPES[self.dtype]

  @property
  def weight_dtype(self) -> Any:
    return _DTYPES[self.param_dtype]

  def replace(self, **changes: Any) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> ModelConfig:
    """Builds a config from a ConfigDict/dict, rejecting unknown keys by name."""
    values = dict(values)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"unknown model config key(s): {', '.join(unknown)}; "
                       f"known keys: {', '.join(sorted(known))}")
    return cls(**values)
