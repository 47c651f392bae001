"""The typed model configuration shared by BERT and GPT.

Config files (ml_collections) hold a `model` group; it becomes a frozen `ModelConfig` at
the model boundary so that model code reads typed fields, not dictionary keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import jax.numpy as jnp

Family = Literal["bert", "gpt"]
NormPosition = Literal["post", "pre"]
# "gelu" is the exact erf form (Hugging Face "gelu"); "gelu_tanh" is the tanh approximation
# used by google-research/bert's TF code and by GPT-2 (Hugging Face "gelu_new").
Activation = Literal["gelu", "gelu_tanh", "relu"]
RematPolicy = Literal["none", "full", "dots", "dots_no_batch"]
DropoutRng = Literal["hash", "threefry"]
EmbedLookup = Literal["gather", "one_hot"]
Attention = Literal["auto", "xla", "splash", "cudnn"]
MatmulOutput = Literal["auto", "compute", "float32"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a BERT encoder or a GPT decoder."""

  # "bert" (bidirectional encoder, MLM/NSP heads) or "gpt" (causal decoder, tied LM head).
  family: Family
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  # Width of the MLP's hidden layer (4 * hidden_size in every paper config).
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
  # norms, softmax and losses stay float32 (bertjax/models/precision.py).
  dtype: str = "float32"
  # Dtype of the stored parameters (float32 master weights under mixed precision).
  param_dtype: str = "float32"
  # What matmuls write: "compute" (the compute dtype: TPU, GPU), "float32" (the float32
  # accumulator: the fast bf16 path of XLA's CPU backend), or "auto" (per platform).
  matmul_output: MatmulOutput = "auto"
  # GPT: sequence positions per chunk of the LM head and its loss (bertjax/objectives.py's
  # chunked_lm_loss): the [B, L, V] logits are never materialised. 0: the whole logits at
  # once. Must divide the sequence length.
  loss_chunk: int = 0
  # Activation checkpointing of each block: what the backward pass may keep.
  remat_policy: RematPolicy = "none"
  # Stack layers with nn.scan: compile time stays flat in depth.
  scan_layers: bool = True
  # Number of labels of a sequence-classification head (fine-tuning).
  num_labels: int = 2

  def __post_init__(self) -> None:
    if self.hidden_size % self.num_heads:
      raise ValueError(
          f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
    if self.dropout_rng not in ("hash", "threefry"):
      raise ValueError(f"model.dropout_rng must be 'hash' or 'threefry', got {self.dropout_rng!r}")
    if self.embed_lookup not in ("gather", "one_hot"):
      raise ValueError(f"model.embed_lookup must be 'gather' or 'one_hot', got "
                       f"{self.embed_lookup!r}")
    if self.attention not in ("auto", "xla", "splash", "cudnn"):
      raise ValueError(f"model.attention must be one of auto, xla, splash, cudnn, got "
                       f"{self.attention!r}")
    if self.matmul_output not in ("auto", "compute", "float32"):
      raise ValueError(f"model.matmul_output must be one of auto, compute, float32, got "
                       f"{self.matmul_output!r}")
    if self.loss_chunk < 0 or (self.loss_chunk and self.family != "gpt"):
      raise ValueError(f"model.loss_chunk must be 0 or, for a GPT model, a positive number of "
                       f"positions, got {self.loss_chunk!r} (family {self.family!r})")
    if self.family not in ("bert", "gpt"):
      raise ValueError(f"model.family must be 'bert' or 'gpt', got {self.family!r}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"model.{name} must be one of {sorted(_DTYPES)}, got "
                         f"{getattr(self, name)!r}")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def compute_dtype(self) -> Any:
    return _DTYPES[self.dtype]

  @property
  def weight_dtype(self) -> Any:
    return _DTYPES[self.param_dtype]

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> "ModelConfig":
    """Builds a config from a ConfigDict/dict, rejecting unknown keys by name."""
    values = dict(values)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"unknown model config key(s): {', '.join(unknown)}; "
                       f"known keys: {', '.join(sorted(known))}")
    return cls(**values)
