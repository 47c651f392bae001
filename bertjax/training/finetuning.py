"""`bertjax finetune`: pre-trained weights on a task — BERT for sentence / sentence-pair
classification (GLUE), regression (STS-B), token classification (NER) and extractive question
answering (SQuAD v1.1/v2.0); GPT on prompts and completions (instructions, dialogue,
summaries) — fully or parameter-efficiently (LoRA, adapters, prefix tuning).

The weights come from a params-only checkpoint, a training workdir (the parameters of its
latest or a given step) or a Hugging Face directory; a BERT gets a fresh head (on the pooled
[CLS] output, on every token, or the span head), a GPT keeps its tied LM head. Training runs on
the one trainer (bertjax.training.trainer.Trainer) with the task's objective (bertjax.training.objectives) and the
config `trainer_config` builds from the spec: the same jitted, sharded, donated step as
pre-training. What a task reads and how it is scored lives in bertjax.finetune.tasks; this module runs
the epochs, evaluates, keeps the best parameters and writes them.

Optimisation follows Devlin et al.'s fine-tuning recipe: AdamW (weight decay 0.01 on kernels
and embeddings only, bertjax.training.optim.decay_mask), linear warmup over `warmup_fraction` of the
steps then linear decay to 0, gradients clipped to global norm 1. The head may have its own
(larger) learning rate and parts of the model may be frozen (bertjax.training.optim: `freeze`,
`head_learning_rate`, options pre-training has too): "embeddings", "bottom:K" (the embeddings
and encoder layers 0..K-1), "all_but_head" (feature extraction), "base" (everything but the
parameter-efficient additions and the head) — frozen parameters get a zero update
(bit-identical after training) and, when frozen whole, no optimizer state. Named presets of
these settings: bertjax.finetune.recipes (`--recipe`).

After every epoch (or every `eval_every` steps) the dev set is scored with the task's metrics;
the best parameters by `spec.metric` are kept and written at the end as a params-only
checkpoint (OUT/best, with finetune.json: task, labels, metric, settings) that `export_hf` turns
into a Hugging Face BertForSequenceClassification / BertForTokenClassification /
BertForQuestionAnswering or GPT LM head model. With parameter-efficient tuning OUT/best holds only
the trained parameters (the additions and the head) and names its base weights; the export
merges LoRA into the base, and `export_peft` writes the unmerged adapter for `peft`.
`patience` stops after that many evaluations without improvement. OUT/metrics.jsonl has one
line per evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from bertjax.checkpoints import weights as weights_lib
from bertjax.checkpoints import params as checkpoint

from bertjax.models.groups import parse_freeze
from bertjax.training import objectives

from bertjax.parallel import sharding

from bertjax.finetune import tasks
from bertjax.checkpoints.weights import FINETUNE_FILE
from bertjax.finetune import labeled
from bertjax.models import ModelConfig
from bertjax.training.trainer import Trainer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FinetuneSpec:
  """Everything a fine-tuning run needs besides its files (no config file involved)."""

  # classification | regression | token_classification | question_answering (BERT) |
  # completion (GPT: prompt/completion or chat JSONL)
  task: str = "classification"
  # Input columns (names, or 0-based numbers for header-less TSV/CSV); text_b for pairs.
  text_a: str = "sentence"
  text_b: str | None = None
  label: str = "label"
  # Token classification JSONL fields.
  tokens: str = "tokens"
  tags: str = "tags"
  # TSV/CSV files have a header row (CoLA's do not: use column numbers and header=False).
  header: bool = True
  # Number of labels: inferred from the training labels (1 for regression); checked if given.
  num_labels: int | None = None
  # Selection metric for the best checkpoint and early stopping (default by task:
  # accuracy / pearson / f1 / f1 / loss). Classification also reports f1 (binary) and
  # matthews; regression pearson, spearman, mse; token classification f1 (entity-level),
  # accuracy; question answering exact_match, f1; completion loss, perplexity.
  metric: str | None = None
  learning_rate: float = 2e-5
  # The new head's peak learning rate (None: learning_rate).
  head_learning_rate: float | None = None
  batch_size: int = 32
  eval_batch_size: int | None = None
  epochs: float = 3.0
  warmup_fraction: float = 0.1
  weight_decay: float = 0.01
  clip_norm: float = 1.0
  # none | embeddings | bottom:K | all_but_head | base (train only LoRA/adapter/prefix
  # parameters and the head)
  freeze: str = "none"
  # Stop after this many evaluations without improvement (0: never).
  patience: int = 0
  # Evaluate every N steps (0: at the end of every epoch).
  eval_every: int = 0
  # Tokens per row: a sentence (pair), a question-answering window, a packed completion row.
  seq_length: int = 128
  # Question answering: tokens between the starts of a context's overlapping windows.
  doc_stride: int = 128
  # Question answering: question tokens kept (longer questions are cut).
  max_query_length: int = 64
  # Question answering: longest answer decoded, in tokens.
  max_answer_length: int = 30
  # Question answering: start and end candidates considered per window.
  n_best: int = 20
  # Question answering (SQuAD v2.0): answer "no answer" unless the best span's score beats
  # the null score by more than this.
  null_threshold: float = 0.0
  # Completion: held-out prompts generated from after training (OUT/generations.jsonl).
  generate_examples: int = 8
  # Completion: tokens generated per held-out prompt (greedy, to <|endoftext|>).
  max_new_tokens: int = 32
  # LoRA rank (0: off).
  lora_rank: int = 0
  # LoRA scaling alpha: the update is scaled by alpha/rank (0: peft's default, 8).
  lora_alpha: float = 0.0
  # Dropout on the LoRA branch's input.
  lora_dropout: float = 0.0
  # LoRA target modules, comma-separated: BERT query,key,value,out,wi,wo; GPT qkv,out,wi,wo
  # (empty: peft's default, BERT query,value, GPT qkv).
  lora_targets: str = ""
  # Bottleneck adapters' width after each attention and MLP block (0: off).
  adapter_size: int = 0
  # Learned key/value prefix positions per layer (0: off).
  prefix_length: int = 0
  seed: int = 0
  # Dropout override (None: the checkpoint's hidden/attention dropout).
  dropout: float | None = None
  # Tokenizer (vocab.txt, spm .model or a directory); None: the one shipped with init_from.
  tokenizer: str | None = None
  lowercase: bool | None = None
  # With init_from=None: the model to initialise at random (tests, from-scratch baselines).
  model: ModelConfig | None = None
  # With a training workdir: its checkpoint step (None: latest).
  step: int | None = None
  # Mesh axis sizes (bertjax.parallel.sharding.make_mesh) and sharding rules when no mesh is given.
  mesh_axes: dict = dataclasses.field(default_factory=lambda: {"data": -1})
  rules: str = "fsdp_tensor"
  # Also write OUT/hf (Hugging Face) from the best parameters (and OUT/peft with LoRA).
  export_hf: bool = False
  log_every: int = 50

  def __post_init__(self) -> None:
    tasks.task(self.task)
    parse_freeze(self.freeze)
    added = self.lora_rank or self.adapter_size or self.prefix_length
    if self.freeze == "base" and not added:
      raise ValueError("freeze=base trains only LoRA / adapter / prefix parameters (and a BERT "
                       "head): set lora_rank, adapter_size or prefix_length, or freeze "
                       "all_but_head")
    if self.export_hf and (self.adapter_size or self.prefix_length):
      raise ValueError("export_hf: adapters and prefixes have no transformers equivalent "
                       "(only LoRA merges into the weights); leave export_hf off")
    if not 0 <= self.warmup_fraction < 1:
      raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")

  @property
  def selection_metric(self) -> str:
    return self.metric or tasks.TASKS[self.task].metric

  @property
  def family(self) -> str:
    return tasks.TASKS[self.task].family

  def columns(self) -> labeled.Columns:
    return labeled.Columns(self.text_a, self.text_b, self.label, self.tokens, self.tags)

  def model_changes(self) -> dict[str, Any]:
    """The parameter-efficient additions and the dropout override, as ModelConfig changes."""
    changes: dict[str, Any] = {}
    if self.dropout is not None:
      changes.update(hidden_dropout=self.dropout, attention_dropout=self.dropout)
    if self.lora_rank:
      changes.update(lora_rank=self.lora_rank, lora_dropout=self.lora_dropout,
                     lora_targets=self.lora_targets)
      if self.lora_alpha:
        changes["lora_alpha"] = self.lora_alpha
    if self.adapter_size:
      changes["adapter_size"] = self.adapter_size
    if self.prefix_length:
      changes["prefix_length"] = self.prefix_length
    return changes


# Below this width the paper's rate (tuned for BERT-base/large) barely moves the weights in a
# few epochs: the README's tiny BERT stays at chance with it (docs/finetuning.md).
_SMALL_MODEL_WIDTH = 512


def recipe_note(spec: FinetuneSpec, hidden_size: int) -> str | None:
  """A hint when a small model is fine-tuned at BERT-base's default learning rate, else None."""
  if hidden_size >= _SMALL_MODEL_WIDTH or spec.learning_rate != FinetuneSpec.learning_rate:
    return None
  return (f"learning rate {spec.learning_rate:g} is BERT-base's recipe; a {hidden_size}-wide "
          "model may stay near chance with it: try e.g. --learning-rate 1e-3 --epochs 10 "
          "(docs/finetuning.md)")


# Read back by the same helper `init_from` uses (weights_lib.load_weights).
load_finetuned = weights_lib.load_finetuned


_EXPORT_HEADS = {"classification": "sequence_classification",
                 "regression": "sequence_classification",
                 "token_classification": "token_classification",
                 "question_answering": "question_answering", "completion": "pretraining"}


def export_hf(directory: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
  """A fine-tuned OUT/best as a Hugging Face directory: BertForSequenceClassification
  (classification, regression), BertForTokenClassification, BertForQuestionAnswering or the
  GPT LM head model, with id2label and the tokenizer. LoRA is merged into the base weights
  (adapters and prefixes have no plain `transformers` equivalent: an error says so)."""
  from bertjax import hf
  from bertjax.models import peft as adapters
  params, config, info = load_finetuned(directory)
  if config.lora_rank:
    params, config = adapters.merge_lora(params, config)
  labels = info.get("labels") or None
  return hf.export_hf(params, config, out_dir, dtype, checkpoint.tokenizer_dir(directory),
                      head=_EXPORT_HEADS[info["task"]], labels=labels)


def export_peft(directory: str | Path, out_dir: str | Path) -> Path:
  """A LoRA fine-tune's OUT/best as a `peft` adapter directory (adapter_config.json,
  adapter_model.safetensors) for the base model exported by `export_hf` of its base."""
  params, config, info = load_finetuned(directory)
  if not info.get("base") or not config.lora_rank:
    raise ValueError(f"{directory}: not a --freeze base LoRA fine-tune; only such a run has an "
                     "adapter apart from its base weights (export it with --format hf)")
  from bertjax.hf import peft
  return peft.export_peft(params, config, out_dir, info.get("base") or "",
                              head=_EXPORT_HEADS[info["task"]])


# --- the run -----------------------------------------------------------------------------

def trainer_config(spec: FinetuneSpec, model: ModelConfig, total_steps: int
                   ) -> ml_collections.ConfigDict:
  """The one trainer's config for a fine-tuning run: the task as the objective, the recipe as
  the optimizer group (warmup as a fraction of the steps, linear decay to 0)."""
  from bertjax.config.schema import optimizer_group
  opt = optimizer_group()
  opt.update(dict(name="adamw", learning_rate=spec.learning_rate,
                  warmup_steps=round(spec.warmup_fraction * total_steps), schedule="linear",
                  power=1.0, end_lr_fraction=0.0, decay_steps=0, b1=0.9, b2=0.999, eps=1e-6,
                  weight_decay=spec.weight_decay, clip_norm=spec.clip_norm,
                  freeze=spec.freeze, head_learning_rate=spec.head_learning_rate or 0.0))
  return ml_collections.ConfigDict({
      "model": dataclasses.asdict(model), "objective": objectives.objective_of(spec.task),
      "optimizer": opt, "num_train_steps": total_steps, "grad_accum_steps": 1,
      "sharding_rules": spec.rules, "seed": spec.seed})


def _better(metric: str, value: float, best: float | None) -> bool:
  if best is None:
    return True
  return value < best if metric in tasks.LOWER_IS_BETTER else value > best


def _start_weights(spec: FinetuneSpec, init_from: str | Path | None) -> weights_lib.Weights:
  """What training starts from: a BERT's encoder (its checkpoint's heads make way for the
  task's fresh one), a GPT whole (its LM head is the tied embedding), or nothing (spec.model
  initialised at random)."""
  if not init_from:
    if spec.model is None:
      raise ValueError("finetune: give init_from, or spec.model for a random initialisation")
    return weights_lib.Weights(None, spec.model, None, "random init")
  weights = weights_lib.load_weights(init_from, spec.step)
  if weights.config.family != spec.family:
    raise ValueError(f"{init_from}: a {weights.config.family} model; task {spec.task} needs "
                     f"a {spec.family} model")
  if spec.family == "gpt":
    return weights
  if "bert" not in weights.params:
    raise ValueError(f"{init_from}: no BERT encoder in these parameters (top-level keys: "
                     f"{', '.join(weights.params)})")
  return dataclasses.replace(weights, params={"bert": weights.params["bert"]})


def finetune(spec: FinetuneSpec, init_from: str | Path | None, train_path: str | Path,
             dev_path: str | Path, out_dir: str | Path, mesh: Mesh | None = None
             ) -> dict[str, Any]:
  """Fine-tunes on `train_path`, scoring `dev_path`; writes OUT/metrics.jsonl and the best
  parameters to OUT/best (and OUT/hf, OUT/peft with spec.export_hf). Returns a summary: the
  selection metric, best value/step/epoch, the evaluation history, labels and the output
  paths."""
  from bertjax.data.tokenizers import load_tokenizer
  out = Path(out_dir)
  is_main = jax.process_index() == 0
  if is_main:
    out.mkdir(parents=True, exist_ok=True)
  if (out / "best").exists():
    raise FileExistsError(f"{out / 'best'} already exists; choose a new output directory")

  start = _start_weights(spec, init_from)
  positions = start.config.max_positions
  if spec.seq_length > positions:
    raise ValueError(f"seq_length={spec.seq_length} exceeds the model's max_positions="
                     f"{positions} (a --recipe sets its paper's length; give --seq-length)")
  if spec.family == "gpt" and spec.max_new_tokens >= positions:
    raise ValueError(f"max_new_tokens={spec.max_new_tokens} leaves no room for a prompt in the "
                     f"model's {positions} positions")
  tokenizer_path = spec.tokenizer or start.tokenizer
  if tokenizer_path is None:
    raise ValueError(f"{start.source} ships no tokenizer: set spec.tokenizer")
  tokenizer = load_tokenizer(tokenizer_path, _lowercase(spec, tokenizer_path),
                             require=spec.family)
  data = tasks.build(spec, tokenizer, train_path, dev_path)
  config = start.config.replace(**data.model_changes, **spec.model_changes())
  if len(tokenizer) > config.vocab_size:
    raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                     f"only {config.vocab_size}")
  if is_main and spec.family == "bert" and (note := recipe_note(spec, config.hidden_size)):
    log.warning("%s", note)

  # The one trainer: mesh, shardings, the initial state (a fresh head on the encoder).
  mesh = mesh or sharding.make_mesh(dict(spec.mesh_axes))
  eval_batch = spec.eval_batch_size or spec.batch_size
  num_rows = len(data.train["input_ids"])
  steps_per_epoch = math.ceil(num_rows / spec.batch_size)
  total_steps = max(1, round(spec.epochs * steps_per_epoch))
  trainer = Trainer(trainer_config(spec, config, total_steps), mesh)
  for size in (spec.batch_size, eval_batch):
    sharding.check_batch(size, 1, mesh, trainer.rules)
  state = trainer.init_state(spec.seed)
  if start.params is not None:
    state, _, _ = trainer.with_weights(state, start.params, start.source)
  trainer.compile_step(tasks.take(data.train, np.arange(spec.batch_size) % num_rows))
  metric = spec.selection_metric
  log.info("fine-tuning %s from %s: %d train / %d dev examples (%d training rows), %d steps "
           "(%d per epoch), mesh %s, freeze %s", spec.task, start.source, data.num_train,
           data.num_dev, num_rows, total_steps, steps_per_epoch, dict(mesh.shape), spec.freeze)

  history: list[dict[str, Any]] = []
  best: dict[str, Any] = {"value": None, "step": 0, "epoch": 0.0}
  best_params = None
  stale = 0
  order_rng = np.random.RandomState(spec.seed)
  metrics_path = out / "metrics.jsonl"
  start_time = time.perf_counter()
  step = 0
  stopped_early = False
  with jax.set_mesh(mesh):
    while step < total_steps and not stopped_early:
      order = order_rng.permutation(num_rows)
      for b in range(steps_per_epoch):
        if step >= total_steps:
          break
        # The last batch of an epoch is filled up from the epoch's start.
        idx = order[np.arange(b * spec.batch_size, (b + 1) * spec.batch_size) % len(order)]
        state, step_metrics = trainer.step(state, tasks.put(tasks.take(data.train, idx),
                                                            trainer.batch_shardings))
        step += 1
        if spec.log_every and step % spec.log_every == 0:
          log.info("step %d/%d loss %.4f lr %.3g", step, total_steps,
                   float(step_metrics["loss"]), float(step_metrics["learning_rate"]))
        end_of_epoch = b == steps_per_epoch - 1 or step == total_steps
        due = (step % spec.eval_every == 0) if spec.eval_every else end_of_epoch
        if not (due or step == total_steps):
          continue
        scores = data.evaluate(trainer, state.params)
        if metric not in scores:
          raise ValueError(f"metric {metric!r} is not reported for {spec.task} "
                           f"({', '.join(scores)})")
        record = {"step": step, "epoch": round(step / steps_per_epoch, 4),
                  "train_loss": float(step_metrics["loss"]),
                  "elapsed_s": round(time.perf_counter() - start_time, 2),
                  **{f"dev_{k}": v for k, v in scores.items()}}
        history.append(record)
        if is_main:
          with metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        log.info("eval at step %d: %s", step,
                 ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
        if _better(metric, scores[metric], best["value"]):
          best = {"value": scores[metric], "step": step, "epoch": record["epoch"]}
          best_params = jax.tree.map(jnp.copy, state.params)
          stale = 0
        else:
          stale += 1
          if spec.patience and stale >= spec.patience:
            log.info("early stop: %s has not improved for %d evaluations", metric, stale)
            stopped_early = True
            break

  best_dir = _save_best(spec, out / "best", best_params, config, start, init_from,
                        tokenizer_path, {**data.info, "metric": metric, "best": best})
  final = data.final(trainer, best_params, out) if data.final else {}
  hf_dir = peft_dir = None
  if spec.export_hf and is_main:
    hf_dir = export_hf(best_dir, out / "hf")
    if spec.lora_rank and spec.freeze == "base" and init_from:
      peft_dir = export_peft(best_dir, out / "peft")
  return {"metric": metric, "best_value": best["value"], "best_step": best["step"],
          "best_epoch": best["epoch"], "steps": step, "total_steps": total_steps,
          "stopped_early": stopped_early, "labels": data.info.get("labels"),
          "history": history, "best_dir": str(best_dir),
          "hf_dir": str(hf_dir) if hf_dir else None,
          "peft_dir": str(peft_dir) if peft_dir else None, **final}


def _save_best(spec: FinetuneSpec, directory: Path, params: Any, config: ModelConfig,
               start: weights_lib.Weights, init_from: str | Path | None,
               tokenizer_path: str | Path, info: dict[str, Any]) -> Path:
  """OUT/best: the parameters (with freeze=base and a base checkpoint, only the trained
  ones: the additions and the head), finetune.json and the tokenizer."""
  base = None
  from bertjax.models import peft as adapters
  if spec.freeze == "base" and init_from and adapters.has_additions(params):
    params = adapters.trainable_params(params, spec.freeze)
    base = str(Path(init_from).absolute()) if Path(init_from).exists() else str(init_from)
  best_dir = checkpoint.save_params(directory, params, config)
  if jax.process_index() == 0:
    info = {"task": spec.task, **info, "seq_length": spec.seq_length, "freeze": spec.freeze,
            "init_from": str(init_from) if init_from else None, "base": base,
            "base_step": start.step if base else None}
    (best_dir / FINETUNE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    src = Path(tokenizer_path)
    if src.is_file():
      (best_dir / "tokenizer").mkdir(exist_ok=True)
      shutil.copy2(src, best_dir / "tokenizer" / src.name)
    else:
      shutil.copytree(src, best_dir / "tokenizer", dirs_exist_ok=True)
  return Path(best_dir)


def _lowercase(spec: FinetuneSpec, tokenizer_path: str | Path) -> bool | None:
  """spec.lowercase, else a Hugging Face tokenizer_config.json's do_lower_case (cased
  checkpoints), else None (the tokenizer's default)."""
  if spec.lowercase is not None:
    return spec.lowercase
  config = Path(tokenizer_path) / "tokenizer_config.json"
  if config.is_file():
    value = json.loads(config.read_text()).get("do_lower_case")
    return None if value is None else bool(value)
  return None
