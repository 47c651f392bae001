"""`bertjax finetune`: BERT on a labelled task — sentence / sentence-pair classification
(GLUE), regression (STS-B), token classification (NER) — from pre-trained weights.

The encoder comes from a params-only checkpoint, a training workdir (the parameters of its
latest or a given step) or a Hugging Face directory; a fresh head goes on the pooled [CLS]
output (sequence tasks) or on every token. Training runs on the one trainer
(bertjax.train.Trainer) with a fine-tuning objective (bertjax.objectives.Finetuning) and the
config `trainer_config` builds from the spec: the same jitted, sharded, donated step as
pre-training. This module holds what is particular to a labelled task: reading and encoding
the examples, epochs over them, dev scores, keeping the best parameters.

Optimisation follows Devlin et al.'s fine-tuning recipe: AdamW (weight decay 0.01 on kernels
and embeddings only, bertjax.optim.decay_mask), linear warmup over `warmup_fraction` of the
steps then linear decay to 0, gradients clipped to global norm 1. The head may have its own
(larger) learning rate and parts of the encoder may be frozen (bertjax.optim: `freeze`,
`head_learning_rate`, options pre-training has too): "embeddings", "bottom:K" (the embeddings
and encoder layers 0..K-1), "all_but_head" (feature extraction: the whole encoder, pooler
included) — frozen parameters get a zero update (bit-identical after training) and, when
frozen whole, no optimizer state.

After every epoch (or every `eval_every` steps) the dev set is scored with the task's metrics;
the best parameters by `spec.metric` are kept and written at the end as a params-only
checkpoint (OUT/best, with finetune.json: task, labels, metric) that `export_hf` turns into a
Hugging Face BertForSequenceClassification / BertForTokenClassification. `patience` stops after
that many evaluations without improvement. OUT/metrics.jsonl has one line per evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding

from bertjax import checkpoint, objectives, optim, sharding
from bertjax.checkpoint import FINETUNE_FILE
from bertjax.data import labeled
from bertjax.models import ModelConfig, abstract_params
from bertjax.scores import task_scores
from bertjax.train import Trainer

log = logging.getLogger(__name__)

# Metrics where lower is better; every other selection metric is maximised.
_LOWER_IS_BETTER = ("mse", "loss")
_DEFAULT_METRIC = {"classification": "accuracy", "regression": "pearson",
                   "token_classification": "f1"}


@dataclasses.dataclass
class FinetuneSpec:
  """Everything a fine-tuning run needs besides its files (no config file involved)."""

  # classification | regression | token_classification
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
  # accuracy / pearson / f1). Classification also reports f1 (binary) and matthews;
  # regression pearson, spearman, mse; token classification f1 (entity-level), accuracy.
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
  # none | embeddings | bottom:K | all_but_head
  freeze: str = "none"
  # Stop after this many evaluations without improvement (0: never).
  patience: int = 0
  # Evaluate every N steps (0: at the end of every epoch).
  eval_every: int = 0
  seq_length: int = 128
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
  # Mesh axis sizes (bertjax.sharding.make_mesh) and sharding rules when no mesh is given.
  mesh_axes: dict = dataclasses.field(default_factory=lambda: {"data": -1})
  rules: str = "fsdp_tensor"
  # Also write OUT/hf (Hugging Face) from the best parameters.
  export_hf: bool = False
  log_every: int = 50

  def __post_init__(self) -> None:
    if self.task not in labeled.TASKS:
      raise ValueError(f"task must be one of {', '.join(labeled.TASKS)}, got {self.task!r}")
    optim.parse_freeze(self.freeze)
    if not 0 <= self.warmup_fraction < 1:
      raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")

  @property
  def selection_metric(self) -> str:
    return self.metric or _DEFAULT_METRIC[self.task]

  def columns(self) -> labeled.Columns:
    return labeled.Columns(self.text_a, self.text_b, self.label, self.tokens, self.tags)


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


def load_finetuned(directory: str | Path, shardings: Any = None
                   ) -> tuple[Any, ModelConfig, dict[str, Any]]:
  """(params, model config, finetune.json) of a fine-tuned OUT/best directory."""
  directory = Path(directory).absolute()
  info = json.loads((directory / FINETUNE_FILE).read_text())
  model = objectives.model_for(info["task"], checkpoint.load_model_config(directory))
  params, config = checkpoint.load_params(directory, shardings,
                                          abstract=nn.meta.unbox(abstract_params(model)))
  return params, config, info


def export_hf(directory: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
  """A fine-tuned OUT/best as a Hugging Face BertForSequenceClassification (classification,
  regression) or BertForTokenClassification directory, with id2label and the tokenizer."""
  from bertjax import hf
  params, config, info = load_finetuned(directory)
  head = ("token_classification" if info["task"] == "token_classification"
          else "sequence_classification")
  labels = info["labels"] or None
  return hf.export_hf(params, config, out_dir, dtype, checkpoint.tokenizer_dir(directory),
                      head=head, labels=labels)


# --- the run -----------------------------------------------------------------------------

def trainer_config(spec: FinetuneSpec, model: ModelConfig, total_steps: int
                   ) -> ml_collections.ConfigDict:
  """The one trainer's config for a fine-tuning run: the task as the objective, the recipe as
  the optimizer group (warmup as a fraction of the steps, linear decay to 0)."""
  opt = optim.default_optimizer_config()
  opt.update(dict(name="adamw", learning_rate=spec.learning_rate,
                  warmup_steps=round(spec.warmup_fraction * total_steps), schedule="linear",
                  power=1.0, end_lr_fraction=0.0, decay_steps=0, b1=0.9, b2=0.999, eps=1e-6,
                  weight_decay=spec.weight_decay, clip_norm=spec.clip_norm,
                  freeze=spec.freeze, head_learning_rate=spec.head_learning_rate or 0.0))
  return ml_collections.ConfigDict({
      "model": dataclasses.asdict(model), "objective": spec.task, "optimizer": opt,
      "num_train_steps": total_steps, "grad_accum_steps": 1, "sharding_rules": spec.rules,
      "seed": spec.seed})


def _put(arrays: dict[str, np.ndarray], shardings: dict[str, NamedSharding]) -> dict:
  """Host arrays (every process holds all rows) -> global arrays in `shardings`."""
  return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
          for k, v in arrays.items()}


def _rows(data: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, np.ndarray]:
  return {k: v[idx] for k, v in data.items() if k != "word_index"}


def _evaluate(trainer: Trainer, params, data: dict[str, np.ndarray], batch_size: int,
              task: str, label_names: Sequence[str]) -> dict[str, float]:
  n = len(data["labels"])
  preds = []
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size) % n  # the last batch padded with repeats
    out = trainer.predict(params, _put(_rows(data, idx), trainer.batch_shardings))
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      out = multihost_utils.process_allgather(out, tiled=True)
    preds.append(np.asarray(jax.device_get(out))[:min(batch_size, n - start)])
  return task_scores(task, data["labels"], np.concatenate(preds), label_names)


def _better(metric: str, value: float, best: float | None) -> bool:
  if best is None:
    return True
  return value < best if metric in _LOWER_IS_BETTER else value > best


def finetune(spec: FinetuneSpec, init_from: str | Path | None, train_path: str | Path,
             dev_path: str | Path, out_dir: str | Path, mesh: Mesh | None = None
             ) -> dict[str, Any]:
  """Fine-tunes BERT on `train_path`, scoring `dev_path`; writes OUT/metrics.jsonl and the best
  parameters to OUT/best (and OUT/hf with spec.export_hf). Returns a summary: the selection
  metric, best value/step/epoch, the evaluation history, labels and the output paths."""
  from bertjax.data.tokenizers import load_tokenizer
  out = Path(out_dir)
  is_main = jax.process_index() == 0
  if is_main:
    out.mkdir(parents=True, exist_ok=True)
  if (out / "best").exists():
    raise FileExistsError(f"{out / 'best'} already exists; choose a new output directory")

  # Weights and model.
  if init_from:
    weights = checkpoint.load_weights(init_from, spec.step)
    if "bert" not in weights.params:
      raise ValueError(f"{init_from}: no BERT encoder in these parameters (top-level keys: "
                       f"{', '.join(weights.params)})")
    # A checkpoint's own heads (pre-training or an earlier task) make way for a fresh one.
    encoder = checkpoint.Weights({"bert": weights.params["bert"]}, weights.config,
                                 weights.tokenizer, weights.source)
  elif spec.model is not None:
    encoder = checkpoint.Weights(None, spec.model, None, "random init")
  else:
    raise ValueError("finetune: give init_from, or spec.model for a random initialisation")
  tokenizer_path = spec.tokenizer or encoder.tokenizer
  if tokenizer_path is None:
    raise ValueError(f"{encoder.source} ships no tokenizer: set spec.tokenizer")
  tokenizer = load_tokenizer(tokenizer_path, _lowercase(spec, tokenizer_path), require="bert")

  # Data.
  columns = spec.columns()
  train_examples = labeled.read_examples(train_path, spec.task, columns, header=spec.header)
  dev_examples = labeled.read_examples(dev_path, spec.task, columns, header=spec.header)
  label_names = labeled.label_vocabulary(train_examples, spec.task)
  num_labels = 1 if spec.task == "regression" else len(label_names)
  if spec.num_labels is not None and spec.num_labels != num_labels:
    raise ValueError(f"num_labels={spec.num_labels} but {train_path} has {num_labels} "
                     f"label(s): {', '.join(label_names)}")
  if num_labels < 1 or (spec.task != "regression" and num_labels < 2):
    raise ValueError(f"{train_path}: {num_labels} distinct label(s); classification needs 2+")
  train = labeled.encode(train_examples, tokenizer, spec.seq_length, label_names, spec.task)
  dev = labeled.encode(dev_examples, tokenizer, spec.seq_length, label_names, spec.task)

  changes: dict[str, Any] = {"num_labels": num_labels}
  if spec.dropout is not None:
    changes.update(hidden_dropout=spec.dropout, attention_dropout=spec.dropout)
  config = encoder.config.replace(**changes)
  if spec.seq_length > config.max_positions:
    raise ValueError(f"seq_length={spec.seq_length} exceeds the model's max_positions="
                     f"{config.max_positions}")
  if len(tokenizer) > config.vocab_size:
    raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                     f"only {config.vocab_size}")
  if is_main and (note := recipe_note(spec, config.hidden_size)):
    log.warning("%s", note)

  # The one trainer: mesh, shardings, the initial state (a fresh head on the encoder).
  mesh = mesh or sharding.make_mesh(dict(spec.mesh_axes))
  eval_batch = spec.eval_batch_size or spec.batch_size
  steps_per_epoch = math.ceil(len(train["labels"]) / spec.batch_size)
  total_steps = max(1, round(spec.epochs * steps_per_epoch))
  trainer = Trainer(trainer_config(spec, config, total_steps), mesh)
  for size in (spec.batch_size, eval_batch):
    sharding.check_batch(size, 1, mesh, trainer.rules)
  state = trainer.init_state(spec.seed)
  if encoder.params is not None:
    state, _, _ = trainer.with_weights(state, encoder.params, encoder.source)
  trainer.compile_step(_rows(train, np.arange(spec.batch_size) % len(train["labels"])))
  metric = spec.selection_metric
  log.info("fine-tuning %s from %s: %d train / %d dev examples, %d labels, %d steps "
           "(%d per epoch), mesh %s, freeze %s", spec.task, encoder.source,
           len(train["labels"]), len(dev["labels"]), num_labels, total_steps, steps_per_epoch,
           dict(mesh.shape), spec.freeze)

  history: list[dict[str, Any]] = []
  best: dict[str, Any] = {"value": None, "step": 0, "epoch": 0.0}
  best_params = None
  stale = 0
  order_rng = np.random.RandomState(spec.seed)
  metrics_path = out / "metrics.jsonl"
  start_time = time.perf_counter()
  train_loss: list[float] = []
  step = 0
  stopped_early = False
  with jax.set_mesh(mesh):
    while step < total_steps and not stopped_early:
      order = order_rng.permutation(len(train["labels"]))
      for b in range(steps_per_epoch):
        if step >= total_steps:
          break
        # The last batch of an epoch is filled up from the epoch's start.
        idx = order[np.arange(b * spec.batch_size, (b + 1) * spec.batch_size) % len(order)]
        state, step_metrics = trainer.step(state, _put(_rows(train, idx),
                                                       trainer.batch_shardings))
        step += 1
        if spec.log_every and step % spec.log_every == 0:
          train_loss.append(float(step_metrics["loss"]))
          log.info("step %d/%d loss %.4f lr %.3g", step, total_steps, train_loss[-1],
                   float(step_metrics["learning_rate"]))
        end_of_epoch = b == steps_per_epoch - 1 or step == total_steps
        due = (step % spec.eval_every == 0) if spec.eval_every else end_of_epoch
        if not (due or step == total_steps):
          continue
        scores = _evaluate(trainer, state.params, dev, eval_batch, spec.task, label_names)
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

  best_dir = checkpoint.save_params(out / "best", best_params, config)
  if is_main:
    info = {"task": spec.task, "labels": label_names, "metric": metric,
            "best": best, "text_b": spec.text_b is not None,
            "seq_length": spec.seq_length, "init_from": str(init_from) if init_from else None}
    (best_dir / FINETUNE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    src = Path(tokenizer_path)
    if src.is_file():
      (best_dir / "tokenizer").mkdir(exist_ok=True)
      shutil.copy2(src, best_dir / "tokenizer" / src.name)
    else:
      shutil.copytree(src, best_dir / "tokenizer", dirs_exist_ok=True)
  hf_dir = None
  if spec.export_hf and is_main:
    hf_dir = export_hf(best_dir, out / "hf")
  return {"metric": metric, "best_value": best["value"], "best_step": best["step"],
          "best_epoch": best["epoch"], "steps": step, "total_steps": total_steps,
          "stopped_early": stopped_early, "labels": label_names, "history": history,
          "best_dir": str(best_dir), "hf_dir": str(hf_dir) if hf_dir else None}


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


def _check_encoder(encoder: Encoder, target: Any) -> None:
  shapes = lambda tree: {jax.tree_util.keystr(p): tuple(np.shape(x))
                         for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  have, want = shapes(encoder.params), shapes(target)
  problems = [f"bert{k}: {have.get(k)} vs model {v}" for k, v in want.items()
              if have.get(k) != v]
  problems += [f"bert{k}: not in the model" for k in have if k not in want]
  if problems:
    raise ValueError(f"{encoder.source}: the encoder does not fit the model "
                     f"({len(problems)} parameter(s)):\n  " + "\n  ".join(problems[:20]))
