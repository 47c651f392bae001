"""ELECTRA's mapping: parameter names of ElectraForPreTraining (the discriminator),
ElectraForMaskedLM (a generator, or an MLM-trained ELECTRA), ElectraModel and the fine-tuning
heads (ElectraForSequenceClassification, ...ForTokenClassification, ...ForQuestionAnswering),
and its config.json both ways.

The encoder's layers are BERT's (bertjax/hf/bert.py); the embeddings have their own width
(`embedding_size`) and, where it differs from the hidden size, a projection
(`embeddings_project`). A replaced-token-detection model exports as two directories: its
discriminator and its generator (bertjax.models.electra splits them).
"""

from __future__ import annotations

from typing import Any

from bertjax.hf import bert
from bertjax.hf.entries import Entry, HFConversionError, norm, same, transposed
from bertjax.hf.formats import HFFormat
from bertjax.models import ModelConfig

PREFIX = "electra."

# bertjax head -> the transformers class it exports as.
EXPORT_HEADS = {"pretraining": "ElectraForMaskedLM",
                "discriminator": "ElectraForPreTraining",
                "sequence_classification": "ElectraForSequenceClassification",
                "token_classification": "ElectraForTokenClassification",
                "question_answering": "ElectraForQuestionAnswering"}
# A checkpoint's architecture -> the bertjax head its parameters fill (a bare ElectraModel:
# the discriminator's, as released ELECTRA encoders are discriminators).
IMPORT_HEADS = {"ElectraForMaskedLM": "pretraining", "ElectraForPreTraining": "discriminator",
                "ElectraModel": "discriminator"}


def encoder_entries(cfg: ModelConfig, prefix: str) -> list[Entry]:
  entries = bert.embedding_entries(prefix)
  if cfg.embedding_width != cfg.hidden_size:
    entries += [transposed(("bert", "embeddings_project", "kernel"),
                           f"{prefix}embeddings_project.weight"),
                same(("bert", "embeddings_project", "bias"), f"{prefix}embeddings_project.bias")]
  return entries + bert.layer_entries(cfg, prefix)


def entries(cfg: ModelConfig, prefix: str, head: str = "pretraining") -> list[Entry]:
  """The encoder and `head`'s parameters (heads optional: a bare ElectraModel has none)."""
  heads = {
      "pretraining": [
          transposed(("mlm_transform", "kernel"), "generator_predictions.dense.weight", True),
          same(("mlm_transform", "bias"), "generator_predictions.dense.bias", True),
          *norm(("mlm_norm",), "generator_predictions.LayerNorm", True),
          same(("mlm_bias",), "generator_lm_head.bias", True)],
      "discriminator": [
          transposed(("discriminator_predictions", "dense", "kernel"),
                     "discriminator_predictions.dense.weight", True),
          same(("discriminator_predictions", "dense", "bias"),
               "discriminator_predictions.dense.bias", True),
          transposed(("discriminator_predictions", "dense_prediction", "kernel"),
                     "discriminator_predictions.dense_prediction.weight", True),
          same(("discriminator_predictions", "dense_prediction", "bias"),
               "discriminator_predictions.dense_prediction.bias", True)],
      "sequence_classification": [
          transposed(("head_dense", "kernel"), "classifier.dense.weight"),
          same(("head_dense", "bias"), "classifier.dense.bias"),
          transposed(("classifier", "kernel"), "classifier.out_proj.weight"),
          same(("classifier", "bias"), "classifier.out_proj.bias")],
      "token_classification": [transposed(("classifier", "kernel"), "classifier.weight"),
                               same(("classifier", "bias"), "classifier.bias")],
      "question_answering": [transposed(("qa_outputs", "kernel"), "qa_outputs.weight"),
                             same(("qa_outputs", "bias"), "qa_outputs.bias")],
  }
  if head not in heads:
    raise HFConversionError(f"head={head!r}: an ELECTRA exports as one of "
                            f"{', '.join(EXPORT_HEADS.values())}")
  return encoder_entries(cfg, prefix) + heads[head]


def without_equivalent(head: str) -> list[tuple[str, ...]]:
  """bertjax parameters ElectraForMaskedLM lacks: the (unused) NSP head of the MLM model."""
  return [("nsp", "kernel"), ("nsp", "bias")] if head == "pretraining" else []


def tied_copies(prefix: str) -> dict[str, str]:
  """Checkpoint tensors that copy another (bertjax ties them): copy -> original."""
  return {"generator_lm_head.weight": f"{prefix}embeddings.word_embeddings.weight"}


def config_from_hf(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
  """A ModelConfig equivalent to an ELECTRA config.json: BERT's keys, plus the embedding width
  and no pooler."""
  if "ForMultipleChoice" in str(hf.get("architectures")):
    raise HFConversionError("ElectraForMultipleChoice is not supported")
  embedding = hf.get("embedding_size", hf["hidden_size"])
  return bert.config_from_hf(hf, common).replace(
      architecture="electra", pooler=False,
      embedding_size=0 if embedding == hf["hidden_size"] else embedding,
      num_labels=hf.get("num_labels", 2) if "id2label" in hf else 2)


def config_dict(cfg: ModelConfig, dtype: str, act: str, head: str = "pretraining",
                labels: list[str] | None = None) -> dict[str, Any]:
  """The config.json of `head`'s ELECTRA class (`act`: the transformers activation name)."""
  if head not in EXPORT_HEADS:
    raise HFConversionError(f"head={head!r}: an ELECTRA exports as one of "
                            f"{', '.join(EXPORT_HEADS.values())}")
  config = {
      "architectures": [EXPORT_HEADS[head]], "model_type": "electra",
      "vocab_size": cfg.vocab_size, "embedding_size": cfg.embedding_width,
      "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.mlp_dim,
      "hidden_act": act, "hidden_dropout_prob": cfg.hidden_dropout,
      "attention_probs_dropout_prob": cfg.attention_dropout,
      "max_position_embeddings": cfg.max_positions, "type_vocab_size": cfg.type_vocab_size,
      "initializer_range": cfg.initializer_range, "layer_norm_eps": cfg.layer_norm_eps,
      "pad_token_id": 0, "position_embedding_type": "absolute", "tie_word_embeddings": True,
      "summary_type": "first", "summary_use_proj": True, "summary_activation": "gelu",
      "summary_last_dropout": 0.1, "torch_dtype": dtype}
  if head in ("sequence_classification", "token_classification"):
    config.update(bert.label_keys(cfg, head, labels))
  elif head == "question_answering":
    config["num_labels"] = 2
  return config


FORMATS = (HFFormat(
    model_type="electra", family="bert", prefix=PREFIX,
    entries=lambda cfg, prefix, head, tensors: entries(cfg, prefix, head),
    tied_copies=tied_copies, config_from_hf=config_from_hf,
    config_dict=lambda cfg, r: config_dict(cfg, r.dtype, r.activation, r.head, r.labels),
    claims=lambda cfg: cfg.family == "bert" and cfg.architecture == "electra", priority=30,
    check_exportable=bert.check_unshared, heads=EXPORT_HEADS, import_heads=IMPORT_HEADS,
    default_import_head="discriminator",
    without_equivalent=lambda cfg, head: without_equivalent(head)),)
