"""Pre-training objectives: small loss functions chosen by `config.objective`.

Each objective computes *sums* over its part of the batch, divided by normalisers computed
once from the whole global batch (`normalizers`). Gradient accumulation over micro-batches
then adds up to exactly the full-batch gradient, whatever the number of masked tokens in
each micro-batch.

Batches (dicts of arrays) by objective:
- BERT: input_ids, input_mask, segment_ids [B, L]; masked_lm_positions, masked_lm_ids,
  masked_lm_weights [B, P]; next_sentence_labels [B] (1 = random next, as
  google-research/bert; for sentence-order prediction 1 = swapped).
- GPT: input_ids, target_ids, loss_mask, segment_ids, positions [B, L].
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

Array = jax.Array
Batch = dict[str, Array]
# (params, batch, normalizers, dropout rng or None) -> (loss, metric sums already normalised)
LossFn = Callable[[Any, Batch, dict[str, Array], Array | None], tuple[Array, dict[str, Array]]]

OBJECTIVES = ("mlm_nsp", "mlm", "mlm_sop", "causal_lm")


def _weighted_nll(logits: Array, targets: Array, weights: Array) -> tuple[Array, Array]:
  """Sum of weighted negative log-likelihoods and of weighted correct predictions."""
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return (nll * weights).sum(), (correct * weights).sum()


@dataclasses.dataclass(frozen=True)
class BertPretraining:
  """MLM on masked positions only (+ NSP or SOP on the pooled output).

  The MLM loss is google-research/bert's: Σ w·NLL / Σ w over gathered positions, where padded
  prediction slots weigh zero. Total loss = MLM + sentence loss (when enabled).
  """

  model: nn.Module
  sentence_task: bool = True

  def normalizers(self, batch: Batch) -> dict[str, Array]:
    return {"mlm": jnp.maximum(batch["masked_lm_weights"].sum(), 1e-5),
            "sentences": jnp.asarray(batch["input_ids"].shape[0], jnp.float32)}

  def __call__(self, params: Any, batch: Batch, norm: dict[str, Array],
               rng: Array | None) -> tuple[Array, dict[str, Array]]:
    out = self.model.apply(
        {"params": params}, batch["input_ids"], batch["segment_ids"], batch["input_mask"],
        batch["masked_lm_positions"], deterministic=rng is None,
        rngs={"dropout": rng} if rng is not None else {})
    weights = batch["masked_lm_weights"].astype(jnp.float32)
    mlm_nll, mlm_correct = _weighted_nll(out.mlm_logits, batch["masked_lm_ids"], weights)
    metrics = {"mlm_loss": mlm_nll / norm["mlm"], "mlm_accuracy": mlm_correct / norm["mlm"]}
    loss = metrics["mlm_loss"]
    if self.sentence_task:
      ones = jnp.ones_like(batch["next_sentence_labels"], jnp.float32)
      nsp_nll, nsp_correct = _weighted_nll(out.nsp_logits, batch["next_sentence_labels"], ones)
      metrics["nsp_loss"] = nsp_nll / norm["sentences"]
      metrics["nsp_accuracy"] = nsp_correct / norm["sentences"]
      loss = loss + metrics["nsp_loss"]
    return loss, metrics


@dataclasses.dataclass(frozen=True)
class CausalLM:
  """Next-token cross-entropy where `loss_mask` is 1: no loss on padding, and none across a
  packed document boundary (the data sets loss_mask 0 where the target is in another doc)."""

  model: nn.Module

  def normalizers(self, batch: Batch) -> dict[str, Array]:
    return {"tokens": jnp.maximum(batch["loss_mask"].sum().astype(jnp.float32), 1e-5)}

  def __call__(self, params: Any, batch: Batch, norm: dict[str, Array],
               rng: Array | None) -> tuple[Array, dict[str, Array]]:
    logits = self.model.apply(
        {"params": params}, batch["input_ids"], batch.get("positions"),
        batch.get("segment_ids"), deterministic=rng is None,
        rngs={"dropout": rng} if rng is not None else {})
    weights = batch["loss_mask"].astype(jnp.float32)
    nll, correct = _weighted_nll(logits, batch["target_ids"], weights)
    loss = nll / norm["tokens"]
    return loss, {"lm_loss": loss, "lm_accuracy": correct / norm["tokens"]}


def build_objective(name: str, model: nn.Module) -> BertPretraining | CausalLM:
  """`mlm_nsp` (BERT), `mlm` (RoBERTa: no sentence task), `mlm_sop` (ALBERT's sentence-order
  prediction: the same 2-way head, labels say whether the segments were swapped),
  `causal_lm` (GPT)."""
  family = model.config.family
  if name == "causal_lm":
    if family != "gpt":
      raise ValueError("objective causal_lm needs a GPT model (model.family='gpt')")
    return CausalLM(model)
  if name in ("mlm_nsp", "mlm", "mlm_sop"):
    if family != "bert":
      raise ValueError(f"objective {name} needs a BERT model (model.family='bert')")
    return BertPretraining(model, sentence_task=name != "mlm")
  raise ValueError(f"unknown objective {name!r}; objectives: {', '.join(OBJECTIVES)}")
