"""The registry of model families: every fact about a family that code outside its own files
asks, looked up once by `model.family` (`get`) and asked, never compared as a string.

A family is a model file that defines its `Family` record (bertjax/models/encoder.py, gpt.py,
t5.py, bart.py) and a mapping file of its Hugging Face formats (bertjax/hf/); `register` adds
it, also from outside the package. The guide: docs/models.md, "Adding a model family".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

# A ModelConfig: named loosely here, since the config reads this registry.
ModelConfig = Any

# What a family's models are: an encoder (bidirectional, fill-mask, task heads), a decoder
# (causal, generates) or an encoder-decoder (text-to-text, generates from a source).
Kind = Literal["encoder", "decoder", "encoder_decoder"]
KINDS = ("encoder", "decoder", "encoder_decoder")
# (where in the parameter tree, depth) of each layer stack.
LayerStacks = list[tuple[tuple[str, ...], int]]


def _no_check(config: ModelConfig) -> None:
  del config


def _no_head_flops(config: ModelConfig, rows: int, predicted: int) -> float:
  del config, rows, predicted
  return 0.0


@dataclasses.dataclass(frozen=True)
class Family:
  """Every fact about a model family that code outside its own files needs."""

  # The `model.family` value.
  name: str
  kind: Kind
  # (config, head) -> the Flax module a run trains; the head is one of `heads`.
  build: Callable[[ModelConfig, str], Any]
  # (config) -> LayerStacks: where the stacks sit in the parameter tree, and their depths.
  layer_stacks: Callable[[ModelConfig], LayerStacks]
  # The pre-training objectives it trains (bertjax/data/schema.py); the first is a new config's
  # default.
  objectives: tuple[str, ...]
  # Its plain language-model loss: the hard loss a distilled student of this family trains.
  lm_objective: str
  # The heads its models carry (bertjax.models.build_model); "pretraining" first.
  heads: tuple[str, ...] = ("pretraining",)
  # The family-specific model options (ModelConfig fields) it accepts with other than their
  # default value; a family that does not name an option that some family names refuses it.
  options: frozenset[str] = frozenset()
  # Checks of its own options' values (raises ValueError naming the option).
  check: Callable[[ModelConfig], None] = _no_check
  # Kernels initialised from a truncated normal (google-research/bert) instead of a normal.
  truncated_init: bool = False
  # Every layer's attention adds a score bias (T5's relative buckets): no fused kernel.
  score_bias: bool = False
  # No position table: inputs of any length (T5's relative buckets).
  unbounded_positions: bool = False
  # (config, rows, predicted positions) -> the training FLOPs of its heads besides the tied
  # vocabulary projection (BERT's MLM transform, pooler and sentence classifier).
  head_flops: Callable[[ModelConfig, int, int], float] = _no_head_flops
  # The projections LoRA may target (model.lora_targets), peft's default ones, and hints for
  # names that belong to another family's layout.
  lora_targets: tuple[str, ...] = ()
  default_lora_targets: tuple[str, ...] = ()
  lora_hints: dict[str, str] = dataclasses.field(default_factory=dict)
  # The tokenizer style its runs train and its fine-tunes require (bertjax/data/tokenizers.py's
  # STYLES: special tokens and their ids).
  tokenizer_style: str = "bert"
  # The prompt the run summary suggests to `bertjax generate` (fill-mask for an encoder).
  sample_prompt: str = "Once upon a time"

  def __post_init__(self) -> None:
    if self.kind not in KINDS:
      raise ValueError(f"family {self.name!r}: kind must be one of {', '.join(KINDS)}, got "
                       f"{self.kind!r}")
    if not self.heads or self.heads[0] != "pretraining":
      raise ValueError(f"family {self.name!r}: heads must start with 'pretraining'")
    if self.lm_objective not in self.objectives:
      raise ValueError(f"family {self.name!r}: lm_objective {self.lm_objective!r} is not one "
                       f"of its objectives {self.objectives}")

  @property
  def is_encoder(self) -> bool:
    return self.kind == "encoder"

  @property
  def is_decoder(self) -> bool:
    return self.kind == "decoder"

  @property
  def is_encoder_decoder(self) -> bool:
    return self.kind == "encoder_decoder"

  @property
  def default_objective(self) -> str:
    return self.objectives[0]


_FAMILIES: dict[str, Family] = {}


def register(family: Family, replace: bool = False) -> Family:
  """Adds `family` (a name registered before is an error unless `replace`)."""
  if family.name in _FAMILIES and not replace and _FAMILIES[family.name] is not family:
    raise ValueError(f"model family {family.name!r} is registered already")
  _FAMILIES[family.name] = family
  return family


def unregister(name: str) -> None:
  """Removes a family (a test's own, once it is done)."""
  _FAMILIES.pop(name, None)


def get(name: str) -> Family:
  """The family `name`, or a ValueError listing the registered ones."""
  if name not in _FAMILIES:
    raise ValueError(f"model.family must be one of {', '.join(sorted(_FAMILIES))}, got "
                     f"{name!r}")
  return _FAMILIES[name]


def of_kind(kind: str) -> tuple[str, ...]:
  """The registered families of `kind`."""
  return tuple(name for name, family in _FAMILIES.items() if family.kind == kind)


def accepting(option: str) -> tuple[str, ...]:
  """The registered families that accept the family-specific option `option`."""
  return tuple(name for name, family in _FAMILIES.items() if option in family.options)


def family_options() -> frozenset[str]:
  """Every option some family names: the family-specific options."""
  return frozenset().union(*(family.options for family in _FAMILIES.values()))
