"""The checks of a model configuration: one rule for the options a family accepts (its
registry record names them), then each group of options' values, one line naming the option.
`ModelConfig` runs them when it is made; the options: docs/models.md.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from bertjax.models import families, options

# A ModelConfig: named loosely here, since bertjax/models/config.py imports this module.
ModelConfig = Any

# What each option may be, for options whose values are names: the option types' values.
_CHOICES = {name: typing.get_args(kind) for name, kind in (
    ("dropout_rng", options.DropoutRng), ("embed_lookup", options.EmbedLookup),
    ("attention", options.Attention), ("matmul_output", options.MatmulOutput),
    ("position_embedding", options.PositionEmbedding), ("architecture", options.Architecture),
    ("embedding_sharing", options.EmbeddingSharing), ("layer_sharing", options.LayerSharing))}
_FUSED = ("splash", "cudnn")


def check(cfg: ModelConfig) -> None:
  """Raises a one-line ValueError for the first thing wrong with `cfg`."""
  family = families.get(cfg.family)
  if cfg.hidden_size % cfg.num_heads and not cfg.head_size:
    raise ValueError(
        f"hidden_size={cfg.hidden_size} is not divisible by num_heads={cfg.num_heads}")
  for name, allowed in _CHOICES.items():
    if getattr(cfg, name) not in allowed:
      raise ValueError(f"model.{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, "
                       f"got {getattr(cfg, name)!r}")
  check_family_options(cfg, family)
  for name in ("loss_chunk", "head_size", "decoder_layers", "embedding_size",
               "span_boundary_positions", "position_buckets", "max_relative_positions",
               "generator_hidden_size", "generator_num_layers", "generator_num_heads",
               "generator_mlp_dim", "lora_rank", "adapter_size", "prefix_length"):
    if getattr(cfg, name) < 0:
      raise ValueError(f"model.{name} must be >= 0 (0: off or the default), got "
                       f"{getattr(cfg, name)!r}")
  _check_peft(cfg)
  _check_positions(cfg)
  _check_layouts(cfg)
  _check_generator(cfg)
  family.check(cfg)


def check_family_options(cfg: ModelConfig, family: families.Family) -> None:
  """A family-specific option (one some family names) set on a family that does not name it
  is refused, naming the families that accept it."""
  defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
  for name in sorted(families.family_options() - family.options):
    value = getattr(cfg, name)
    if value != defaults[name]:
      accepting = families.accepting(name)
      raise ValueError(f"model.{name}={value!r} is an option of {' and '.join(accepting)} "
                       f"models (model.family), not of a {cfg.family} model")


def _check_peft(cfg: ModelConfig) -> None:
  if not 0.0 <= cfg.lora_dropout < 1.0:
    raise ValueError(f"model.lora_dropout must be in [0, 1), got {cfg.lora_dropout!r}")
  if cfg.lora_rank and cfg.lora_alpha <= 0:
    raise ValueError(f"model.lora_alpha must be > 0, got {cfg.lora_alpha!r}")
  lora_modules(cfg, targets=True)
  if cfg.prefix_length and cfg.attention in _FUSED:
    raise ValueError(f"model.prefix_length={cfg.prefix_length} needs the XLA attention core "
                     f"(its prefix keys are outside the fused kernels' masks): set "
                     f"model.attention=xla or auto, not {cfg.attention!r}")


def lora_modules(cfg: ModelConfig, targets: bool = False) -> tuple[str, ...]:
  """The projections LoRA updates (`lora_targets` resolved against the family's); with
  `targets`, even when LoRA is off (to check the setting)."""
  if not (cfg.lora_rank or targets):
    return ()
  family = families.get(cfg.family)
  if not cfg.lora_targets.strip():
    return family.default_lora_targets
  names = tuple(t.strip() for t in cfg.lora_targets.split(","))
  for name in names:
    if name not in family.lora_targets:
      raise ValueError(f"model.lora_targets: {name!r} is not a LoRA target of a "
                       f"{cfg.family} model{family.lora_hints.get(name, '')}; choose from "
                       f"{', '.join(family.lora_targets) or 'none (no LoRA for this family)'}")
  if len(set(names)) != len(names):
    raise ValueError(f"model.lora_targets lists a target twice: {cfg.lora_targets!r}")
  return names


def _check_positions(cfg: ModelConfig) -> None:
  if cfg.position_embedding == "rotary" and cfg.head_dim % 2:
    raise ValueError(f"model.position_embedding=rotary needs an even head dim, got "
                     f"{cfg.head_dim}")
  if cfg.local_window < 0 or cfg.local_window % 2:
    raise ValueError(f"model.local_window must be 0 (off) or an even number of positions, "
                     f"got {cfg.local_window!r}")
  if cfg.global_every < 1:
    raise ValueError(f"model.global_every must be >= 1, got {cfg.global_every!r}")
  if cfg.prefix_length and (cfg.local_window or cfg.position_embedding in ("alibi", "relative")):
    raise ValueError(f"model.prefix_length={cfg.prefix_length} does not combine with "
                     "sliding-window layers, ALiBi or relative attention (the prefix keys "
                     "have no position)")
  if not cfg.first_attention_norm and cfg.norm_position != "pre":
    raise ValueError("model.first_attention_norm=False is a pre-LN option (layer 0 reads the "
                     "normalised embeddings); set model.norm_position=pre")
  if cfg.position_embedding in ("alibi", "relative") and cfg.attention in _FUSED:
    raise ValueError(f"model.position_embedding={cfg.position_embedding} needs the XLA "
                     f"attention core (the fused kernels take no score bias): set "
                     f"model.attention=xla or auto, not {cfg.attention!r}")


def _check_layouts(cfg: ModelConfig) -> None:
  """The encoder layouts: ELECTRA's, DeBERTa's and ALBERT's embeddings and heads."""
  if (cfg.architecture == "deberta") != (cfg.position_embedding == "relative"):
    raise ValueError("DeBERTa's disentangled attention is its layout: model.architecture="
                     "deberta goes with model.position_embedding=relative and only with it")
  if cfg.architecture in ("electra", "deberta") and cfg.pooler:
    raise ValueError(f"model.architecture={cfg.architecture} has no pooler (its heads read "
                     "[CLS]'s final state): set model.pooler=False")
  if cfg.architecture == "albert" and not cfg.pooler:
    raise ValueError("model.architecture=albert has BERT's tanh pooler (its sentence-order "
                     "head reads it): set model.pooler=True")
  if cfg.embedding_size and cfg.architecture == "bert":
    raise ValueError("model.embedding_size needs model.architecture=electra, deberta or "
                     "albert (the layouts with an embedding projection)")
  terms = cfg.relative_attention_terms.split("|")
  if not terms or any(t not in ("c2p", "p2c") for t in terms) or len(set(terms)) != len(terms):
    raise ValueError(f"model.relative_attention_terms must be c2p|p2c, c2p or p2c, got "
                     f"{cfg.relative_attention_terms!r}")
  if cfg.architecture == "deberta" and cfg.embedding_width != cfg.hidden_size:
    raise ValueError("model.embedding_size: DeBERTa's MLM head multiplies hidden states by the "
                     "word table, so the table's width must be hidden_size")
  if cfg.span_boundary_positions and (cfg.has_generator
                                      or cfg.embedding_width != cfg.hidden_size):
    raise ValueError("model.span_boundary_positions: the span-boundary head predicts through "
                     "the MLM decoder of an encoder of one width, without a generator")


def _check_generator(cfg: ModelConfig) -> None:
  """Replaced-token detection's generator (ELECTRA, DeBERTa-v3)."""
  if not cfg.generator_hidden_size:
    return
  if cfg.architecture in ("bert", "albert"):
    raise ValueError("a generator (model.generator_hidden_size) needs model.architecture="
                     "electra or deberta")
  heads = cfg.generator_num_heads or cfg.num_heads
  if cfg.generator_hidden_size % heads:
    raise ValueError(f"model.generator_hidden_size={cfg.generator_hidden_size} is not "
                     f"divisible by model.generator_num_heads={heads}")
