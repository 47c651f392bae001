"""The values each option of the model configuration may take (bertjax/models/config.py's
`ModelConfig` reads them): layouts, numerics and kernels by name. The families are a
registry of their own (bertjax/models/families.py).
"""

from __future__ import annotations

from typing import Literal

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

MatmulOutput = Literal["auto", "compute", "float32"]
