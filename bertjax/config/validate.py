"""Checks of a loaded config that name the key: settings no run could use fail at start-up."""

from __future__ import annotations

import re

import ml_collections

from bertjax.data.options import CORRUPT_RECORD_MODES, ROW_BALANCE_MODES
from bertjax.data.schema import objective
from bertjax.finetune.registry import task
from bertjax.models import families
from bertjax.models.groups import FREEZE_KINDS, parse_freeze

ConfigDict = ml_collections.ConfigDict


def validate_training(config: ConfigDict) -> None:
  """A ValueError naming the key for a training setting no run could use (before any data is
  read or built: a batch size of 0 used to surface as a ZeroDivisionError minutes later)."""
  def need(key: str, ok: bool, what: str) -> None:
    if not ok:
      value = config
      for part in key.split("."):
        value = value.get(part) if value is not None else None
      raise ValueError(f"--config.{key}={value!r}: {what}")

  need("batch_size", int(config.batch_size) >= 1, "must be at least 1")
  need("num_train_steps", int(config.num_train_steps) >= 1, "must be at least 1")
  # A fine-tune's model is its weights' (checked once they are read).
  family = families.get(config.model.family)
  positions = (int(config.model.max_positions)
               if not config.finetune.task and not family.unbounded_positions
               else int(config.seq_length))
  need("seq_length", 1 <= int(config.seq_length) <= positions,
       f"must be between 1 and model.max_positions ({positions})")
  need("grad_accum_steps", int(config.grad_accum_steps) >= 1, "must be at least 1")
  need("grad_accum_steps", int(config.batch_size) % int(config.grad_accum_steps) == 0,
       f"must divide batch_size ({config.batch_size})")
  need("max_predictions", 0 <= int(config.max_predictions) <= int(config.seq_length),
       "must be between 0 and seq_length")
  need("log_every", int(config.log_every) >= 1, "must be at least 1")
  need("eval_every", int(config.eval_every) >= 0, "must be 0 (never) or more")
  need("eval_steps", int(config.eval_steps) >= 1, "must be at least 1")
  need("checkpoint.every", int(config.checkpoint.every) >= -1,
       "must be -1 (at every evaluation), 0 (at the end) or more")
  need("checkpoint.keep", int(config.checkpoint.keep) >= 0, "must be 0 (all) or more")
  need("data.num_epochs", int(config.data.num_epochs) >= 0, "must be 0 (repeat) or more")
  need("data.epoch_documents", int(config.data.epoch_documents) >= 0,
       "must be 0 (every document of the mixed sources) or more")
  need("data.num_workers", int(config.data.num_workers) >= 0, "must be 0 or more")
  need("data.row_balance", config.data.get("row_balance", "documents") in ROW_BALANCE_MODES,
       f"must be one of {ROW_BALANCE_MODES}")
  need("data.corrupt_records",
       config.data.get("corrupt_records", "skip") in CORRUPT_RECORD_MODES,
       f"must be one of {CORRUPT_RECORD_MODES}")
  need("data.shuffle_window", int(config.data.shuffle_window) >= 0, "must be 0 or more")
  need("data.mask_prob", 0 < float(config.data.mask_prob) < 1, "must be between 0 and 1")
  for key in ("mask_token_prob", "random_token_prob"):
    need(f"data.{key}", 0 <= float(config.data[key]) <= 1, "must be between 0 and 1")
  # Only sentence pairs carry NSP/SOP labels; other instances would train that head on zeros.
  need("data.bert_instances", not objective(config.objective).sentence_pairs
       or config.data.bert_instances == "pairs",
       f"makes no sentence pairs for objective={config.objective!r}: use objective=mlm")
  need("optimizer.learning_rate", float(config.optimizer.learning_rate) > 0,
       "must be positive")
  need("optimizer.freeze", _freeze_ok(str(config.optimizer.freeze)),
       f"must be {FREEZE_KINDS}")
  validate_finetune(config)
  validate_distillation(config)


def validate_distillation(config: ConfigDict) -> None:
  """The `distillation` group of a run that distills (distillation.teacher set): settings no
  teacher could make work. (The teacher itself is read, and its vocabulary, width and depth
  checked against the student, when the run starts: bertjax.training.distillation.)"""
  d = config.get("distillation")
  if d is None or not d.teacher:
    return

  def need(key: str, ok: bool, what: str) -> None:
    if not ok:
      raise ValueError(f"--config.distillation.{key}={d[key]!r}: {what}")

  family = families.get(config.model.family)
  if config.finetune.task:
    raise ValueError(f"--config.distillation.teacher={d.teacher!r}: distillation is a "
                     "pre-training objective; a fine-tune (finetune.task="
                     f"{config.finetune.task!r}) cannot distill")
  hard = family.lm_objective
  if config.objective != hard:
    raise ValueError(f"--config.objective={config.objective!r}: a distilled {family.name} "
                     f"student trains with objective={hard} (its hard loss and batches; "
                     "DistilBERT has no sentence task)")
  need("temperature", float(d.temperature) > 0, "must be positive")
  for key in ("alpha_ce", "alpha_mlm", "alpha_clm", "alpha_cos"):
    need(key, float(d[key]) >= 0, "must be 0 or more")
  need("alpha_ce", sum(float(d[k]) for k in ("alpha_ce", "alpha_mlm", "alpha_clm",
                                              "alpha_cos")) > 0,
       "the loss weights alpha_ce, alpha_mlm, alpha_clm and alpha_cos are all 0")
  if objective(hard).causal:
    need("alpha_mlm", float(d.alpha_mlm) == 0, "a GPT student's hard loss is causal LM: weigh "
         "it with distillation.alpha_clm and set alpha_mlm to 0")
    need("restrict_ce_to_mask", not d.restrict_ce_to_mask, "a causal LM has no masked "
         "positions (its soft loss covers every real token)")
  else:
    need("alpha_clm", float(d.alpha_clm) == 0, "a BERT student's hard loss is masked LM: weigh "
         "it with distillation.alpha_mlm and set alpha_clm to 0")
  need("teacher_step", int(d.teacher_step) >= -1, "must be -1 (the latest) or a step")
  if d.init_from_teacher and config.init_from:
    raise ValueError(f"--config.distillation.init_from_teacher=True and --config.init_from="
                     f"{config.init_from!r}: the student starts from one of them")
  layers = str(d.teacher_layers).strip()
  need("teacher_layers", layers == "every_other" or re.fullmatch(r"\d+(\s*,\s*\d+)*", layers)
       is not None, "must be every_other or a comma-separated list of teacher layer indices "
       "(e.g. 0,2,4,7,9,11)")
  if int(config.model.loss_chunk):
    raise ValueError(f"--config.model.loss_chunk={config.model.loss_chunk}: distillation "
                     "compares the student's and the teacher's whole vocabulary distributions; "
                     "set model.loss_chunk=0")


def _freeze_ok(freeze: str) -> bool:
  try:
    parse_freeze(freeze)
  except ValueError:
    return False
  return True


def validate_finetune(config: ConfigDict) -> None:
  """The `finetune` group of a fine-tuning run (finetune.task set): the task, and settings that
  would train or export nothing. (Its files are checked when the run reads them.)"""
  ft = config.finetune
  if not ft.task:
    return
  task(ft.task)  # a ValueError listing the tasks
  if float(ft.epochs) <= 0:
    raise ValueError(f"--config.finetune.epochs={ft.epochs}: must be positive")
  if not 0 <= float(ft.warmup_fraction) < 1:
    raise ValueError(f"warmup_fraction must be in [0, 1), got {ft.warmup_fraction}")
  model = config.model
  added = model.lora_rank or model.adapter_size or model.prefix_length
  if config.optimizer.freeze == "base" and not added:
    raise ValueError("freeze=base trains only LoRA / adapter / prefix parameters (and a BERT "
                     "head): set lora_rank, adapter_size or prefix_length, or freeze "
                     "all_but_head")
  if ft.export_hf and (model.adapter_size or model.prefix_length):
    raise ValueError("export_hf: adapters and prefixes have no transformers equivalent "
                     "(only LoRA merges into the weights); leave export_hf off")
