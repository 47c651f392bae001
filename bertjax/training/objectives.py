"""Training objectives — pre-training and fine-tuning — as small loss classes chosen by
`config.objective`; the one trainer (bertjax.training.trainer) runs them all.

Each objective computes *sums* over its part of the batch, divided by normalisers computed
once from the whole global batch (`normalizers`). Gradient accumulation over micro-batches
then adds up to exactly the full-batch gradient, whatever the number of masked tokens in
each micro-batch.

The fields each objective reads are its batch schema's (bertjax.data.schema.BATCHES).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from bertjax.data import schema
from bertjax.finetune.labeled import IGNORE
from bertjax.models import families, precision
from bertjax.models.config import ModelConfig
from bertjax.models.spanbert import SpanBertForPreTraining

Array = jax.Array
Batch = dict[str, Array]
# (params, batch, normalizers, dropout rng or None) -> (loss, metric sums already normalised)
LossFn = Callable[[Any, Batch, dict[str, Array], Array | None], tuple[Array, dict[str, Array]]]




def chunked_lm_loss(config: ModelConfig, hidden_BLD: Array, table_VD: Array, targets_BL: Array,
                    weights_BL: Array, chunk: int) -> tuple[Array, Array]:
  """(Σ w·NLL, Σ w·correct) of the tied LM head `hidden @ tableᵀ`, `chunk` positions at a
  time: no [B, L, V] logits tensor exists, forward or backward (at GPT-2's 50,257-word
  vocabulary they outweigh every other activation).

  The derivative is computed in the same pass as the loss (a custom VJP): each chunk's
  logits give softmax − one-hot at once, and from it the gradients of the hidden states and
  of the table; the backward pass only scales them by the loss's cotangent. Nothing is
  recomputed: three products of 2·tokens·V·D each, the model FLOPs of the head. Without a
  derivative (evaluation) only the loss is computed.
  """
  length = hidden_BLD.shape[1]
  if length % chunk:
    raise ValueError(f"model.loss_chunk={chunk} does not divide the sequence length {length}")
  return _chunked_lm_loss(config, chunk, hidden_BLD, table_VD, targets_BL,
                          weights_BL.astype(jnp.float32))


def _chunk_terms(config: ModelConfig, h_BTD: Array, table_VD: Array, targets_BT: Array,
                 weights_BT: Array) -> tuple[Array, Array, Array]:
  """One chunk's weighted NLL and correct sums, and its weighted softmax − one-hot."""
  logits_BTV = precision.product(config, "btd,vd->btv", h_BTD, table_VD)
  log_probs_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  nll_BT = -jnp.take_along_axis(log_probs_BTV, targets_BT[..., None], axis=-1)[..., 0]
  correct_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT).astype(jnp.float32)
  one_hot_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=jnp.float32)
  dlogits_BTV = weights_BT[..., None] * (jnp.exp(log_probs_BTV) - one_hot_BTV)
  return (weights_BT * nll_BT).sum(), (weights_BT * correct_BT).sum(), dlogits_BTV


def _chunks(chunk: int, *arrays: Array):
  """A function of the chunk index returning each array's slice of `chunk` positions."""
  return lambda c: tuple(jax.lax.dynamic_slice_in_dim(a, c * chunk, chunk, axis=1)
                         for a in arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_lm_loss(config, chunk, hidden_BLD, table_VD, targets_BL, weights_BL):
  take = _chunks(chunk, hidden_BLD, targets_BL, weights_BL)

  def body(c, sums):
    h_BTD, t_BT, w_BT = take(c)
    nll, correct, _ = _chunk_terms(config, h_BTD, table_VD, t_BT, w_BT)
    return sums[0] + nll, sums[1] + correct
  zero = jnp.zeros((), jnp.float32)
  return jax.lax.fori_loop(0, hidden_BLD.shape[1] // chunk, body, (zero, zero))


def _chunked_lm_loss_fwd(config, chunk, hidden_BLD, table_VD, targets_BL, weights_BL):
  take = _chunks(chunk, hidden_BLD, targets_BL, weights_BL)

  def body(c, carry):
    nll, correct, grad_hidden_BLD, grad_table_DV = carry
    h_BTD, t_BT, w_BT = take(c)
    chunk_nll, chunk_correct, dlogits_BTV = _chunk_terms(config, h_BTD, table_VD, t_BT, w_BT)
    grad_h_BTD = precision.product(config, "btv,vd->btd", dlogits_BTV, table_VD)
    grad_hidden_BLD = jax.lax.dynamic_update_slice_in_dim(
        grad_hidden_BLD, grad_h_BTD.astype(grad_hidden_BLD.dtype), c * chunk, axis=1)
    # Accumulated as [D, V]: the product's natural order, transposed once at the end.
    grad_table_DV = grad_table_DV + precision.product(config, "btd,btv->dv", h_BTD,
                                                      dlogits_BTV)
    return nll + chunk_nll, correct + chunk_correct, grad_hidden_BLD, grad_table_DV
  zero = jnp.zeros((), jnp.float32)
  init = (zero, zero, jnp.zeros(hidden_BLD.shape, hidden_BLD.dtype),
          jnp.zeros(table_VD.shape[::-1], jnp.float32))
  nll, correct, grad_hidden_BLD, grad_table_DV = jax.lax.fori_loop(
      0, hidden_BLD.shape[1] // chunk, body, init)
  grad_table_VD = grad_table_DV.T.astype(table_VD.dtype)
  return (nll, correct), (grad_hidden_BLD, grad_table_VD)


def _chunked_lm_loss_bwd(config, chunk, residuals, cotangents):
  grad_hidden_BLD, grad_table_VD = residuals
  g_nll = cotangents[0]  # the correct count has no derivative
  return ((g_nll * grad_hidden_BLD).astype(grad_hidden_BLD.dtype),
          (g_nll * grad_table_VD).astype(grad_table_VD.dtype), None, None)


_chunked_lm_loss.defvjp(_chunked_lm_loss_fwd, _chunked_lm_loss_bwd)


def weighted_nll(logits: Array, targets: Array, weights: Array) -> tuple[Array, Array]:
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
    # Packed rows (data.bert_instances="packed") also carry document ids and positions.
    out = self.model.apply(
        {"params": params}, batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
        batch["masked_lm_positions"], deterministic=rng is None,
        document_ids_BL=batch.get("document_ids"), positions_BL=batch.get("positions"),
        rngs={"dropout": rng} if rng is not None else {})
    weights = batch["masked_lm_weights"].astype(jnp.float32)
    mlm_nll, mlm_correct = weighted_nll(out.mlm_logits, batch["masked_lm_ids"], weights)
    metrics = {"mlm_loss": mlm_nll / norm["mlm"], "mlm_accuracy": mlm_correct / norm["mlm"]}
    loss = metrics["mlm_loss"]
    if self.sentence_task:
      ones = jnp.ones_like(batch["next_sentence_labels"], jnp.float32)
      nsp_nll, nsp_correct = weighted_nll(out.nsp_logits, batch["next_sentence_labels"], ones)
      metrics["nsp_loss"] = nsp_nll / norm["sentences"]
      metrics["nsp_accuracy"] = nsp_correct / norm["sentences"]
      loss = loss + metrics["nsp_loss"]
    return loss, metrics


def _scatter_rows(ids_BL: Array, positions_BP: Array, values_BP: Array) -> Array:
  """ids with row b's positions[b, p] set to values[b, p]."""
  rows_BP = jnp.broadcast_to(jnp.arange(ids_BL.shape[0])[:, None], positions_BP.shape)
  return jnp.asarray(ids_BL).at[rows_BP, positions_BP].set(values_BP)


@dataclasses.dataclass(frozen=True)
class ReplacedTokenDetection:
  """ELECTRA's objective (Clark et al. 2020), DeBERTa-v3's too: the generator's MLM loss at the
  masked positions, plus `discriminator_weight` (λ, 50 in both papers) times the
  discriminator's per-token "replaced" loss over every real token.

  The generator's distribution is sampled at each masked position (Gumbel-max under the
  step's key; no gradient flows through the sample) and written into the original ids; a
  token is labelled replaced where the result differs from the original, so a sample equal
  to the original counts as original. Evaluation samples under a fixed key.
  """

  model: nn.Module
  discriminator_weight: float = 50.0

  def normalizers(self, batch: Batch) -> dict[str, Array]:
    return {"mlm": jnp.maximum(batch["masked_lm_weights"].sum(), 1e-5),
            "tokens": jnp.maximum(batch["attention_mask"].sum().astype(jnp.float32), 1e-5)}

  def __call__(self, params: Any, batch: Batch, norm: dict[str, Array],
               rng: Array | None) -> tuple[Array, dict[str, Array]]:
    deterministic = rng is None
    key = jax.random.key(0) if rng is None else rng
    generator_key, sample_key, discriminator_key = jax.random.split(key, 3)
    input_ids, positions = batch["input_ids"], batch["masked_lm_positions"]
    types, attention_mask = batch["token_type_ids"], batch["attention_mask"]
    weights = batch["masked_lm_weights"].astype(jnp.float32)
    gen_logits = self.model.apply(
        {"params": params}, input_ids, types, attention_mask, positions, deterministic,
        method="generate", rngs={} if deterministic else {"dropout": generator_key})
    mlm_nll, mlm_correct = weighted_nll(gen_logits, batch["masked_lm_ids"], weights)

    predicted = weights > 0
    at_positions = jnp.take_along_axis(input_ids, positions, axis=1)
    sampled_BP = jax.random.categorical(sample_key, jax.lax.stop_gradient(gen_logits))
    original_BL = _scatter_rows(input_ids, positions,
                                jnp.where(predicted, batch["masked_lm_ids"], at_positions))
    corrupted_BL = _scatter_rows(input_ids, positions,
                                 jnp.where(predicted, sampled_BP.astype(input_ids.dtype),
                                           at_positions))
    replaced_BL = (corrupted_BL != original_BL).astype(jnp.float32)
    disc_logits_BL = self.model.apply(
        {"params": params}, corrupted_BL, types, attention_mask, deterministic,
        method="discriminate", rngs={} if deterministic else {"dropout": discriminator_key})
    real_BL = attention_mask.astype(jnp.float32)
    disc_nll = (optax.sigmoid_binary_cross_entropy(disc_logits_BL, replaced_BL) * real_BL).sum()
    disc_correct = (((disc_logits_BL > 0) == (replaced_BL > 0)) * real_BL).sum()
    metrics = {"mlm_loss": mlm_nll / norm["mlm"], "mlm_accuracy": mlm_correct / norm["mlm"],
               "disc_loss": disc_nll / norm["tokens"],
               "disc_accuracy": disc_correct / norm["tokens"],
               "replaced_fraction": (replaced_BL * real_BL).sum() / norm["tokens"]}
    return metrics["mlm_loss"] + self.discriminator_weight * metrics["disc_loss"], metrics


@dataclasses.dataclass(frozen=True)
class SpanBoundaryPretraining:
  """loss = MLM + SBO, each Σ w·NLL / Σ w over the masked positions (SpanBERT's criterion
  `span_bert_loss` with `--pair-loss-weight 1.0`: both losses per target, summed).

  MLM's weights are `masked_lm_weights`; SBO's the same where the position has an SBO target
  (`span_offsets` 1 .. the head's `max_span_length`; 0: its span touches the sequence's edge or
  the position lies deeper in its span than the head has rows). Both predict the original
  token, `masked_lm_ids`. No sentence task (SpanBERT drops NSP).
  """

  model: nn.Module

  def _sbo_weights(self, batch: Batch) -> Array:
    offsets = batch["span_offsets"]
    has_target = (offsets >= 1) & (offsets <= self.model.max_span_length)
    return batch["masked_lm_weights"].astype(jnp.float32) * has_target

  def normalizers(self, batch: Batch) -> dict[str, Array]:
    return {"mlm": jnp.maximum(batch["masked_lm_weights"].sum(), 1e-5),
            "sbo": jnp.maximum(self._sbo_weights(batch).sum(), 1e-5)}

  def __call__(self, params: Any, batch: Batch, norm: dict[str, Array],
               rng: Array | None) -> tuple[Array, dict[str, Array]]:
    out = self.model.apply(
        {"params": params}, batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
        batch["masked_lm_positions"], deterministic=rng is None,
        document_ids_BL=batch.get("document_ids"), positions_BL=batch.get("positions"),
        span_left_positions_BP=batch["span_left_positions"],
        span_right_positions_BP=batch["span_right_positions"],
        span_offsets_BP=batch["span_offsets"],
        rngs={"dropout": rng} if rng is not None else {})
    targets = batch["masked_lm_ids"]
    mlm_nll, mlm_correct = weighted_nll(out.mlm_logits, targets,
                                         batch["masked_lm_weights"].astype(jnp.float32))
    sbo_nll, sbo_correct = weighted_nll(out.sbo_logits, targets, self._sbo_weights(batch))
    metrics = {"mlm_loss": mlm_nll / norm["mlm"], "mlm_accuracy": mlm_correct / norm["mlm"],
               "sbo_loss": sbo_nll / norm["sbo"], "sbo_accuracy": sbo_correct / norm["sbo"]}
    return metrics["mlm_loss"] + metrics["sbo_loss"], metrics


@dataclasses.dataclass(frozen=True)
class CausalLM:
  """Next-token cross-entropy where `loss_mask` is 1: no loss on padding, and none across a
  packed document boundary (the data sets loss_mask 0 where the target is in another doc)."""

  model: nn.Module

  def normalizers(self, batch: Batch) -> dict[str, Array]:
    return {"tokens": jnp.maximum(batch["loss_mask"].sum().astype(jnp.float32), 1e-5)}

  def __call__(self, params: Any, batch: Batch, norm: dict[str, Array],
               rng: Array | None) -> tuple[Array, dict[str, Array]]:
    cfg = self.model.config
    inputs = (batch["input_ids"], batch.get("positions"), batch.get("document_ids"))
    rngs = {"dropout": rng} if rng is not None else {}
    weights = batch["loss_mask"].astype(jnp.float32)
    if cfg.loss_chunk:
      hidden_BLD, table_VD = self.model.apply({"params": params}, *inputs,
                                              deterministic=rng is None, rngs=rngs,
                                              method="features")
      nll, correct = chunked_lm_loss(cfg, hidden_BLD, table_VD, batch["target_ids"], weights,
                                     cfg.loss_chunk)
    else:
      logits = self.model.apply({"params": params}, *inputs, deterministic=rng is None,
                                rngs=rngs)
      nll, correct = weighted_nll(logits, batch["target_ids"], weights)
    loss = nll / norm["tokens"]
    return loss, {"lm_loss": loss, "lm_accuracy": correct / norm["tokens"]}


@dataclasses.dataclass(frozen=True)
class Seq2SeqLM:
  """An encoder-decoder's next-token cross-entropy on the decoder's targets where `loss_mask`
  is 1 (T5's span corruption, BART's denoising, text-to-text fine-tuning); the examples packed
  into a row are told apart by their ids in the encoder's and the decoder's rows."""

  model: nn.Module

  def normalizers(self, batch: Batch) -> dict[str, Array]:
    return {"tokens": jnp.maximum(batch["loss_mask"].sum().astype(jnp.float32), 1e-5)}

  def __call__(self, params: Any, batch: Batch, norm: dict[str, Array],
               rng: Array | None) -> tuple[Array, dict[str, Array]]:
    logits = self.model.apply(
        {"params": params}, batch["input_ids"], batch["decoder_input_ids"],
        encoder_segments_BS=batch["document_ids"],
        decoder_segments_BL=batch["decoder_document_ids"], deterministic=rng is None,
        rngs={"dropout": rng} if rng is not None else {})
    nll, correct = weighted_nll(logits, batch["target_ids"],
                                batch["loss_mask"].astype(jnp.float32))
    loss = nll / norm["tokens"]
    return loss, {"lm_loss": loss, "lm_accuracy": correct / norm["tokens"]}


@dataclasses.dataclass(frozen=True)
class Finetuning:
  """A task head on BERT: cross-entropy over classes (`classification`: sentence or pair
  on the pooled [CLS]; `token_classification`: every token whose label is not IGNORE), mean
  squared error of one output (`regression`, STS-B), or the mean of the start and end
  positions' cross-entropies over each window's tokens (`question_answering`, as Hugging Face's
  BertForQuestionAnswering). Means over the global batch's examples (or labelled tokens), as
  sums divided by normalisers, so accumulation changes nothing. `predict` gives what the
  task's dev metrics score: classes, the regression output, or the span logits [B, L, 2]
  (bertjax.finetune.squad decodes answers from them)."""

  model: nn.Module
  task: str = "classification"

  def normalizers(self, batch: Batch) -> dict[str, Array]:
    if self.task == "token_classification":
      labelled = (batch["labels"] != IGNORE).sum().astype(jnp.float32)
      return {"examples": jnp.maximum(labelled, 1.0)}
    return {"examples": jnp.asarray(batch["input_ids"].shape[0], jnp.float32)}

  def _logits(self, params: Any, batch: Batch, rng: Array | None) -> Array:
    return self.model.apply({"params": params}, batch["input_ids"], batch["token_type_ids"],
                            batch["attention_mask"], deterministic=rng is None,
                            rngs={"dropout": rng} if rng is not None else {})

  def __call__(self, params: Any, batch: Batch, norm: dict[str, Array],
               rng: Array | None) -> tuple[Array, dict[str, Array]]:
    logits = self._logits(params, batch, rng)
    if self.task == "question_answering":
      # [B, L] per boundary; one class per token position.
      start = optax.softmax_cross_entropy_with_integer_labels(logits[..., 0],
                                                              batch["start_positions"])
      end = optax.softmax_cross_entropy_with_integer_labels(logits[..., 1],
                                                            batch["end_positions"])
      exact = ((jnp.argmax(logits[..., 0], -1) == batch["start_positions"])
               & (jnp.argmax(logits[..., 1], -1) == batch["end_positions"]))
      return (0.5 * (start + end).sum() / norm["examples"],
              {"span_accuracy": exact.sum() / norm["examples"]})
    labels = batch["labels"]
    if self.task == "regression":
      loss = ((logits[:, 0] - labels) ** 2).sum() / norm["examples"]
      return loss, {}
    valid = labels != IGNORE
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    correct = (jnp.argmax(logits, -1) == labels) & valid
    loss = jnp.sum(jnp.where(valid, nll, 0.0)) / norm["examples"]
    return loss, {"accuracy": correct.sum() / norm["examples"]}

  def predict(self, params: Any, batch: Batch) -> Array:
    logits = self._logits(params, batch, None)
    if self.task == "question_answering":
      return logits
    if self.task == "regression":
      return logits[:, 0]
    return jnp.argmax(logits, -1).astype(jnp.int32)


def build_objective(name: str, model: nn.Module, discriminator_weight: float = 50.0
                    ) -> (BertPretraining | SpanBoundaryPretraining | ReplacedTokenDetection
                          | CausalLM | Seq2SeqLM | Finetuning):
  """`mlm_nsp` (BERT), `mlm` (RoBERTa: no sentence task), `mlm_sop` (ALBERT's sentence-order
  prediction: the same 2-way head, labels say whether the segments were swapped), `mlm_sbo`
  (SpanBERT: MLM plus the span-boundary objective), `rtd`
  (ELECTRA, DeBERTa-v3: a generator and its discriminator, `discriminator_weight` λ),
  `causal_lm` (GPT), `span_corruption` (T5), `denoising` (BART); `classification`,
  `regression`, `token_classification`, `question_answering` (BERT with its fine-tuning task's
  head: bertjax.finetune.tasks) and `text_to_text` (T5, BART: the decoder's targets).
  Knowledge distillation builds on these (bertjax.training.distillation.objective)."""
  spec = schema.objective(name)
  config = model.config
  family = config.family_record
  if spec.trains != family.kind:
    needed = " or ".join(families.of_kind(spec.trains))
    raise ValueError(f"objective {name} needs a{'n' if needed[0] in 'aeiou' else ''} "
                     f"{needed} model (model.family), got a {config.family} model")
  if spec.pretraining and name not in family.objectives:
    raise ValueError(f"objective {name!r}: a {config.family} model pre-trains with "
                     f"{', '.join(family.objectives)}")
  if spec.causal:
    return CausalLM(model)
  if spec.seq2seq:
    return Seq2SeqLM(model)
  if spec.finetuning:
    return Finetuning(model, name)
  if spec.replaced_tokens:
    if not config.has_generator:
      raise ValueError(f"objective {name} needs an encoder with a generator "
                       "(model.generator_hidden_size > 0)")
    return ReplacedTokenDetection(model, discriminator_weight)
  if spec.span_boundary:
    if not isinstance(model, SpanBertForPreTraining):
      raise ValueError(f"objective {name} needs SpanBERT's span-boundary head "
                       "(model.span_boundary_positions > 0; SpanBERT: 10)")
    return SpanBoundaryPretraining(model)
  return BertPretraining(model, sentence_task=spec.sentence_pairs)
