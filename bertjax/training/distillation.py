"""Knowledge distillation (Hinton et al. 2015) as an objective of the one trainer: DistilBERT
(Sanh et al. 2019) and distilgpt2, after huggingface/transformers'
examples/research_projects/distillation (distiller.py, train.py).

A frozen teacher (the train state's `teacher`: outside the gradient and the optimizer, never
checkpointed or exported) runs in the same jitted train step as the student, the run's model.
The loss is DistilBERT's weighted sum (distiller.py's `step`) of the soft KL term, the
student's own MLM or causal-LM loss and the cosine term on the last hidden states.

The guide: docs/training.md, 'Distillation (`config.distillation`)'.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from bertjax.checkpoints.weights import load_teacher, teacher_config
from bertjax.data import schema
from bertjax.models import attention, build_model, distill, init_params, layers, precision
from bertjax.models.bert import gather_positions
from bertjax.models.config import ModelConfig
from bertjax.training.objectives import weighted_nll

Array = jax.Array
Batch = dict[str, Array]

# torch.nn.functional.cosine_embedding_loss's guard against zero vectors.
COSINE_EPS = 1e-12


def enabled(config: ml_collections.ConfigDict) -> bool:
  """Whether a run config distills (distillation.teacher is set)."""
  group = config.get("distillation")
  return group is not None and bool(group.get("teacher"))


@dataclasses.dataclass(frozen=True)
class Teacher:
  """A distillation teacher: where its weights are and the model they are run with (the
  saved model's shape and layout, the run's numerics: compute dtype, attention core, no
  dropout)."""

  source: str
  step: int | None
  config: ModelConfig

  def model(self) -> nn.Module:
    return build_model(self.config)

  def boxed_abstract(self) -> Any:
    """The teacher's parameters as shapes with their logical axes (what shardings are made
    from), allocating nothing."""
    return jax.eval_shape(lambda r: init_params(self.model(), r), jax.random.key(0))

  def abstract(self) -> Any:
    """The teacher's parameters as shapes and dtypes (the state's `teacher`)."""
    return jax.eval_shape(lambda r: nn.meta.unbox(init_params(self.model(), r)),
                          jax.random.key(0))

  def load(self, abstract: Any) -> Any:
    """The weights, placed in the shardings of `abstract` (ShapeDtypeStructs)."""
    return load_teacher(self.source, self.step, abstract)


def teacher_of(config: ml_collections.ConfigDict, student: ModelConfig,
               platform: str) -> Teacher:
  """The teacher a run config names, its model config read from its files (no parameter is
  read) and checked against the student: one family, one vocabulary, room for the run's
  sequences, the width the cosine term compares, the layers `init_from_teacher` takes. Every
  mismatch is a one-line ValueError naming the key."""
  d = config.distillation
  step = None if int(d.teacher_step) < 0 else int(d.teacher_step)
  saved = teacher_config(d.teacher, step)
  where = f"--config.distillation.teacher={str(d.teacher)!r}"
  if saved.family != student.family:
    raise ValueError(f"{where}: a {saved.family} teacher for a {student.family} student "
                     "(model.family)")
  if saved.has_generator:
    raise ValueError(f"{where}: a replaced-token-detection model; a teacher is a language "
                     "model (its discriminator has no vocabulary distribution)")
  if saved.vocab_size != student.vocab_size:
    raise ValueError(f"{where}: the teacher's vocabulary has {saved.vocab_size} entries, the "
                     f"student's (model.vocab_size) {student.vocab_size}; the two must share "
                     "one tokenizer (build the data with the teacher's)")
  longest = max(int(config.seq_length), int(config.phase2.seq_length or 0))
  if saved.position_embedding == "learned" and saved.max_positions < longest:
    raise ValueError(f"{where}: the teacher reads at most {saved.max_positions} positions, "
                     f"the run's sequences have {longest} (seq_length)")
  if float(d.alpha_cos) > 0 and saved.hidden_size != student.hidden_size:
    raise ValueError(f"--config.distillation.alpha_cos={d.alpha_cos}: the cosine loss compares "
                     f"hidden states of one width; the teacher's is {saved.hidden_size}, the "
                     f"student's (model.hidden_size) {student.hidden_size} (set alpha_cos=0)")
  if d.init_from_teacher:
    distill.teacher_layers(str(d.teacher_layers), saved.num_layers, student.num_layers)
  run = saved.replace(dtype=student.dtype, matmul_output=str(config.model.matmul_output),
                      attention=str(config.model.attention), hidden_dropout=0.0,
                      attention_dropout=0.0, lora_dropout=0.0, remat_policy="none",
                      loss_chunk=0)
  run = precision.resolve(attention.resolve(run, platform), platform)
  return Teacher(str(d.teacher), step, run)


def _tied_logits(cfg: ModelConfig, hidden_BLD: Array, table_VD: Array) -> Array:
  """A GPT's LM head from `GPT.features`: the hidden states (layout pinned, as
  layers.tied_logits) times the tied table, fp32 logits [B, L, V]."""
  hidden_BLD = layers.constrain(hidden_BLD, layers.ACT_BLD)
  logits_BLV = precision.einsum(cfg, "bld,vd->blv", hidden_BLD, table_VD)
  return layers.constrain(logits_BLV, ("batch", "length", "vocab")).astype(jnp.float32)


def _kl_sum(student_logits: Array, teacher_logits: Array, temperature: float,
            weights: Array) -> tuple[Array, Array]:
  """(Σ w·KL(p_t ‖ p_s), Σ w·H(p_t)) over positions, both distributions at `temperature`."""
  log_s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  log_t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
  p_t = jnp.exp(log_t)
  kl = jnp.sum(p_t * (log_t - log_s), axis=-1)
  entropy = -jnp.sum(p_t * log_t, axis=-1)
  return (weights * kl).sum(), (weights * entropy).sum()


def _cosine_sum(student_BLD: Array, teacher_BLD: Array, weights_BL: Array) -> Array:
  """Σ w·(1 − cos) over tokens, torch's cosine_embedding_loss with target 1."""
  s = student_BLD.astype(jnp.float32)
  t = teacher_BLD.astype(jnp.float32)
  dot = jnp.sum(s * t, axis=-1)
  norms = jnp.sqrt((jnp.sum(s * s, axis=-1) + COSINE_EPS) * (jnp.sum(t * t, axis=-1)
                                                              + COSINE_EPS))
  return (weights_BL * (1.0 - dot / norms)).sum()


@dataclasses.dataclass(frozen=True)
class Distillation:
  """The distillation objective of a student `model` and a `teacher` module (the module-level
  docstring has the loss). Called like every objective, with the teacher's parameters as
  `teacher` (the train state's); its metrics: soft_loss (T²·KL), teacher_entropy, the hard
  loss and accuracy under the student objective's names (mlm_* or lm_*), the teacher's hard
  loss on the same batch (teacher_mlm_loss / teacher_lm_loss) and cos_loss."""

  model: nn.Module
  teacher: nn.Module
  temperature: float = 2.0
  alpha_ce: float = 5.0
  # alpha_mlm (BERT) or alpha_clm (GPT): the weight of the student's own LM loss.
  alpha_lm: float = 2.0
  alpha_cos: float = 1.0
  restrict_ce_to_mask: bool = False

  @property
  def causal(self) -> bool:
    return self.model.config.is_decoder

  def _real(self, batch: Batch) -> Array:
    """1.0 at every real (non-padding) token."""
    if self.causal:
      return (batch["document_ids"] > 0).astype(jnp.float32)
    return batch["attention_mask"].astype(jnp.float32)

  def _soft_weights(self, batch: Batch) -> Array:
    if self.restrict_ce_to_mask:
      return batch["masked_lm_weights"].astype(jnp.float32)
    return self._real(batch)

  def normalizers(self, batch: Batch) -> dict[str, Array]:
    norm = {"soft": jnp.maximum(self._soft_weights(batch).sum(), 1e-5),
            "tokens": jnp.maximum(self._real(batch).sum(), 1e-5)}
    if self.causal:
      norm["lm"] = jnp.maximum(batch["loss_mask"].sum().astype(jnp.float32), 1e-5)
    else:
      norm["lm"] = jnp.maximum(batch["masked_lm_weights"].sum(), 1e-5)
    return norm

  def _outputs(self, module: nn.Module, params: Any, batch: Batch, rng: Array | None,
               positions: Array | None, token_types: Array | None) -> tuple[Array, Array]:
    """(logits, last hidden states [B, L, D]) of one model on the batch: GPT at every position,
    BERT at `positions` (None: every position)."""
    rngs = {"dropout": rng} if rng is not None else {}
    if self.causal:
      hidden, table = module.apply(
          {"params": params}, batch["input_ids"], batch.get("positions"),
          batch.get("document_ids"), deterministic=rng is None, rngs=rngs, method="features")
      return _tied_logits(module.config, hidden, table), hidden
    out = module.apply(
        {"params": params}, batch["input_ids"], token_types, batch["attention_mask"],
        positions, deterministic=rng is None, document_ids_BL=batch.get("document_ids"),
        positions_BL=batch.get("positions"), rngs=rngs)
    return out.mlm_logits, out.sequence

  def __call__(self, params: Any, batch: Batch, norm: dict[str, Array], rng: Array | None,
               teacher: Any = None) -> tuple[Array, dict[str, Array]]:
    if teacher is None:
      raise ValueError("the distillation objective needs the teacher's parameters (teacher=)")
    positions = batch["masked_lm_positions"] if self.restrict_ce_to_mask else None
    types = None
    if not self.causal:
      types = batch["token_type_ids"]
    s_logits, s_hidden = self._outputs(self.model, params, batch, rng, positions, types)
    # A student without segment embeddings (DistilBERT) reads none: neither does its teacher,
    # as distiller.py calls both with the ids and mask alone.
    t_types = (types if types is None or self.model.config.type_vocab_size
               else jnp.zeros_like(types))
    t_logits, t_hidden = jax.lax.stop_gradient(
        self._outputs(self.teacher, teacher, batch, None, positions, t_types))
    if self.causal:
      targets, weights = batch["target_ids"], batch["loss_mask"].astype(jnp.float32)
      s_hard, t_hard = s_logits, t_logits
      prefix = "lm"
    else:
      targets = batch["masked_lm_ids"]
      weights = batch["masked_lm_weights"].astype(jnp.float32)
      if positions is None:  # logits at every position: the masked ones for the hard loss
        s_hard = gather_positions(s_logits, batch["masked_lm_positions"])
        t_hard = gather_positions(t_logits, batch["masked_lm_positions"])
      else:
        s_hard, t_hard = s_logits, t_logits
      prefix = "mlm"
    nll, correct = weighted_nll(s_hard, targets, weights)
    t_nll, _ = weighted_nll(t_hard, targets, weights)
    kl, entropy = _kl_sum(s_logits, t_logits, self.temperature, self._soft_weights(batch))
    t2 = self.temperature ** 2
    metrics = {"soft_loss": t2 * kl / norm["soft"],
               "teacher_entropy": entropy / norm["soft"],
               f"{prefix}_loss": nll / norm["lm"],
               f"{prefix}_accuracy": correct / norm["lm"],
               f"teacher_{prefix}_loss": t_nll / norm["lm"]}
    loss = self.alpha_ce * metrics["soft_loss"] + self.alpha_lm * metrics[f"{prefix}_loss"]
    if s_hidden.shape[-1] == t_hidden.shape[-1]:
      metrics["cos_loss"] = _cosine_sum(s_hidden, t_hidden, self._real(batch)) / norm["tokens"]
      loss = loss + self.alpha_cos * metrics["cos_loss"]
    return loss, metrics


def objective(name: str, model: nn.Module, teacher: Teacher,
              settings: ml_collections.ConfigDict) -> Distillation:
  """The distillation objective over the student objective `name` (mlm for BERT, causal_lm for
  GPT: the hard loss and the batches) with `settings` (a run config's distillation group)."""
  family = model.config.family_record
  hard = family.lm_objective
  if name != hard:
    raise ValueError(f"objective {name!r}: a distilled {family.name} student trains with "
                     f"objective {hard} (its hard loss and batches)")
  return Distillation(
      model, teacher.model(), temperature=float(settings.temperature),
      alpha_ce=float(settings.alpha_ce),
      alpha_lm=float(settings.alpha_clm if schema.objective(hard).causal
                     else settings.alpha_mlm),
      alpha_cos=float(settings.alpha_cos),
      restrict_ce_to_mask=bool(settings.restrict_ce_to_mask))


def student_from_teacher(student: Any, teacher: Any, student_cfg: ModelConfig,
                         teacher_cfg: ModelConfig, spec: str, shardings: Any
                         ) -> tuple[Any, list[str]]:
  """The student's parameters initialised from the teacher's (bertjax.models.distill), computed
  on the devices into the student's `shardings` (the student's own buffers donated). Returns
  them and the names that kept their initialisation."""
  layer_map = distill.teacher_layers(spec, teacher_cfg.num_layers, student_cfg.num_layers)
  kept: list[str] = []

  def mapped(s: Any, t: Any) -> Any:
    params, _, fresh = distill.student_from_teacher(s, t, student_cfg, teacher_cfg, layer_map)
    kept[:] = fresh
    return params

  params = jax.jit(mapped, out_shardings=shardings, donate_argnums=(0,))(student, teacher)
  return params, kept


def describe(teacher: Teacher) -> str:
  """One line for the run's log: where the teacher is and what it is."""
  cfg = teacher.config
  return (f"distilling from {teacher.source}"
          f"{'' if teacher.step is None else f' (step {teacher.step})'}: {cfg.family} "
          f"{cfg.num_layers}x{cfg.hidden_size}, {cfg.num_heads} heads, vocabulary "
          f"{cfg.vocab_size}")
