"""The values each option of the model configuration may take (bertjax/models/config.py's
`ModelConfig` reads them): families, layouts, numerics and kernels by name.
"""

from __future__ import annotations

from typing import Literal

# The encoder-decoders: "t5" (Raffel et al. 2020, transformers' T5ForConditionalGeneration,
# bertjax/models/t5.py) and "bart" (Lewis et al. 2020, BartForConditionalGeneration,
# bertjax/models/bart.py).
Family = Literal["bert", "gpt", "t5", "bart"]
ENCODER_DECODERS = ("t5", "bart")
UNBOUNDED_POSITIONS = ("t5",)  # relative buckets, no position table: inputs of any length
NormPosition = Literal["post", "pre"]
# "gelu" is the exact erf form (Hugging Face "gelu"); "gelu_tanh" is the tanh approximation
# used by google-research/bert's TF code and by GPT-2 (Hugging Face "gelu_new").
Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]
PositionEmbedding = Literal["learned", "rotary", "alibi", "relative"]
# The Hugging Face encoder whose embedding and head layout a BERT-family model follows.
Architecture = Literal["bert", "electra", "deberta", "albert"]
EmbeddingSharing = Literal["shared", "gdes"]
# Cross-layer parameter sharing (ALBERT, Lan et al. 2020, Table 4): which part of a layer all
# layers hold in common.
LayerSharing = Literal["none", "all", "attention", "ffn"]
RematPolicy = Literal["none", "full", "dots", "dots_no_batch"]
DropoutRng = Literal["hash", "threefry"]
EmbedLookup = Literal["gather", "one_hot"]
Attention = Literal["auto", "xla", "splash", "cudnn"]

# The projections LoRA may target, per family (`lora_targets`), and peft's default targets
# (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: BERT query/value, GPT-2 c_attn).
LORA_TARGETS = {"bert": ("query", "key", "value", "out", "wi", "wo"),
                "gpt": ("qkv", "out", "wi", "wo")}
DEFAULT_LORA_TARGETS = {"bert": ("query", "value"), "gpt": ("qkv",)}
MatmulOutput = Literal["auto", "compute", "float32"]
