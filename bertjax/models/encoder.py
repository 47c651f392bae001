"""The encoder family ("bert"): BERT and the encoders built from its options (RoBERTa,
MosaicBERT, ModernBERT, ELECTRA, DeBERTa-v3, ALBERT, SpanBERT, DistilBERT), with the heads
they pre-train and fine-tune with. Its registry record; the models: docs/models.md.
"""

from __future__ import annotations

import flax.linen as nn

from bertjax.models.bert import (
  BertForPreTraining,
  BertForQuestionAnswering,
  BertForSequenceClassification,
  BertForTokenClassification,
)
from bertjax.models.config import ModelConfig
from bertjax.models.electra import ElectraDiscriminator, ReplacedTokenDetection
from bertjax.models.families import Family, LayerStacks
from bertjax.models.spanbert import SpanBertForPreTraining

# The heads an encoder can carry; the names are also those of the Hugging Face export's head.
HEADS = {"pretraining": BertForPreTraining,
         "sequence_classification": BertForSequenceClassification,
         "token_classification": BertForTokenClassification,
         "question_answering": BertForQuestionAnswering,
         "discriminator": ElectraDiscriminator}


def build(config: ModelConfig, head: str) -> nn.Module:
  """BERT with its pre-training heads or a task's head. A model with a generator pre-trains by
  replaced-token detection (both models in one module); its discriminator alone is the
  "discriminator" head (transformers' ElectraForPreTraining)."""
  if head == "pretraining" and config.has_generator:
    return ReplacedTokenDetection(config)
  if head == "pretraining" and config.span_boundary_positions:
    return SpanBertForPreTraining(config, max_span_length=config.span_boundary_positions)
  if head != "pretraining" and config.has_generator:
    # A fine-tune or the discriminator alone: the generator is not part of it.
    config = config.discriminator_config()
  return HEADS[head](config)


def layer_stacks(config: ModelConfig) -> LayerStacks:
  return [(("bert", "encoder"), config.num_layers)]


def head_flops(config: ModelConfig, rows: int, predicted: int) -> float:
  """The MLM transform (width x embedding width per predicted position), the pooler (width²
  per row) and the 2-way sentence classifier."""
  d, e = config.hidden_size, config.embedding_width
  pooler = d * d if config.pooler else 0
  return float(6 * d * e * predicted + 6 * (pooler + 2 * d) * rows)


FAMILY = Family(
    name="bert", kind="encoder", build=build, layer_stacks=layer_stacks,
    objectives=("mlm_nsp", "mlm", "mlm_sop", "mlm_sbo", "rtd"), lm_objective="mlm",
    heads=tuple(HEADS),
    options=frozenset({
        "position_embedding", "mlp_gated", "local_window", "first_attention_norm",
        "architecture", "embedding_size", "layer_sharing", "span_boundary_positions",
        "generator_hidden_size", "generator_num_layers", "generator_num_heads",
        "generator_mlp_dim", "embedding_sharing", "lora_rank", "adapter_size",
        "prefix_length"}),
    truncated_init=True, head_flops=head_flops,
    lora_targets=("query", "key", "value", "out", "wi", "wo"),
    default_lora_targets=("query", "value"),
    lora_hints={"qkv": " (BERT's fused kernel is targeted per slice: query, key, value)"},
    sample_prompt="The capital of France is [MASK].")
