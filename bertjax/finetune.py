"""`bertjax finetune`: BERT on a labelled task — sentence / sentence-pair classification
(GLUE), regression (STS-B), token classification (NER) — from pre-trained weights.

The encoder comes from a params-only checkpoint, a training workdir (the parameters of its
latest or a given step) or a Hugging Face directory; a fresh head goes on the pooled [CLS]
output (sequence tasks) or on every token. The train step is jitted once over a mesh with the
parameters in the shardings their logical axes give (bertjax.sharding) and the state donated,
as in pre-training (bertjax.train).

Optimisation follows Devlin et al.'s fine-tuning recipe: AdamW (weight decay 0.01 on kernels
and embeddings only, bertjax.optim.decay_mask), linear warmup over `warmup_fraction` of the
steps then linear decay to 0, gradients clipped to global norm 1. The head may have its own
(larger) learning rate. Freezing: "embeddings", "bottom:K" (the embeddings and encoder layers
0..K-1), "all_but_head" (feature extraction: the whole encoder, pooler included) — frozen
parameters get a zero update (bit-identical after training) and, when frozen whole, no
optimizer state.

After every epoch (or every `eval_every` steps) the dev set is scored with the task's metrics;
the best parameters by `spec.metric` are kept and written at the end as a params-only
checkpoint (OUT/best, with finetune.json: task, labels, metric) that `export_hf` turns into a
Hugging Face BertForSequenceClassification / BertForTokenClassification. `patience` stops after
that many evaluations without improvement. OUT/metrics.jsonl has one line per evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax import checkpoint, optim, sharding
from bertjax.data import labeled
from bertjax.models import ModelConfig, init_params, jit_init
from bertjax.models.bert import (
  BertForPreTraining,
  BertForSequenceClassification,
  BertForTokenClassification,
)
from bertjax.task_metrics import task_metrics
from bertjax.train import TrainState, batch_shardings, optimizer_state_shardings

log = logging.getLogger(__name__)

FINETUNE_FILE = "finetune.json"
# Metrics where lower is better; every other selection metric is maximised.
_LOWER_IS_BETTER = ("mse", "loss")
_DEFAULT_METRIC = {"classification": "accuracy", "regression": "pearson",
                   "token_classification": "f1"}
_EMBEDDINGS = ("word_embeddings", "position_embeddings", "token_type_embeddings",
               "embeddings_norm")


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
    parse_freeze(self.freeze)
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


# --- freezing and the optimizer ----------------------------------------------------------

def parse_freeze(freeze: str) -> tuple[str, int]:
  """"none" | "embeddings" | "bottom:K" | "all_but_head" -> (kind, K)."""
  if freeze in ("none", "embeddings", "all_but_head"):
    return freeze, 0
  match = re.fullmatch(r"bottom:(\d+)", freeze)
  if match:
    return "bottom", int(match.group(1))
  raise ValueError(f"freeze must be none, embeddings, bottom:K or all_but_head, got {freeze!r}")


def _names(path) -> tuple[str, ...]:
  return tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def frozen_rows(params: Any, freeze: str, num_layers: int) -> Any:
  """Per leaf: True (frozen whole), False (trained), or a bool array [layers, 1, ...] that is
  True for the frozen layers of a scanned layer stack."""
  kind, k = parse_freeze(freeze)
  if kind == "bottom" and k > num_layers:
    raise ValueError(f"freeze=bottom:{k} but the model has {num_layers} layers")

  def rule(path, leaf):
    names = _names(path)
    if names[0] != "bert" or kind == "none":
      return False
    if kind == "all_but_head":
      return True
    if names[1] in _EMBEDDINGS:
      return True
    if kind != "bottom" or names[1] != "encoder":
      return False
    layer = names[2]
    if layer == "layers":  # scanned: the leading axis is the layer
      if k >= num_layers:
        return True
      if k == 0:
        return False
      rows = np.arange(num_layers) < k
      return rows.reshape((num_layers,) + (1,) * (len(leaf.shape) - 1))
    return int(layer.split("_")[1]) < k
  return jax.tree_util.tree_map_with_path(rule, params)


def _keep_updates(frozen: Any) -> optax.GradientTransformation:
  """Zeroes the gradient/update of frozen parameters (rows of a scanned stack included)."""
  def keep(u, f):
    if isinstance(f, np.ndarray):
      return jnp.where(jnp.asarray(f), jnp.zeros_like(u), u)
    return jnp.zeros_like(u) if f else u

  def update(updates, state, params=None):
    del params
    return jax.tree.map(keep, updates, frozen), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def build_optimizer(spec: FinetuneSpec, params: Any, num_layers: int, total_steps: int
                    ) -> tuple[optax.GradientTransformation, dict[str, optax.Schedule]]:
  """Frozen parameters -> zero updates (no state when frozen whole); the encoder and the head
  with their own peak learning rates, both warmed up then decayed linearly."""
  frozen = frozen_rows(params, spec.freeze, num_layers)
  labels = jax.tree_util.tree_map_with_path(
      lambda path, f: ("frozen" if f is True else
                       "pretrained" if _names(path)[0] == "bert" else "head"), frozen)
  warmup = round(spec.warmup_fraction * total_steps)

  def warmup_then_linear_decay(peak: float) -> optax.Schedule:  # pre-training's "linear"
    opt = optim.default_optimizer_config()
    opt.update(dict(learning_rate=peak, warmup_steps=warmup, schedule="linear",
                    end_lr_fraction=0.0, decay_steps=0, power=1.0))
    return optim.learning_rate_schedule(opt, total_steps)

  schedules = {"pretrained": warmup_then_linear_decay(spec.learning_rate),
               "head": warmup_then_linear_decay(spec.head_learning_rate or spec.learning_rate)}
  adamw = lambda s: optax.adamw(s, b1=0.9, b2=0.999, eps=1e-6,
                                weight_decay=spec.weight_decay, mask=optim.decay_mask)
  chain = [_keep_updates(frozen)]
  if spec.clip_norm > 0:
    chain.append(optax.clip_by_global_norm(spec.clip_norm))
  chain += [optax.multi_transform({"frozen": optax.set_to_zero(),
                                   "pretrained": adamw(schedules["pretrained"]),
                                   "head": adamw(schedules["head"])}, labels),
            # Decoupled weight decay moves a parameter with zero gradient: frozen rows of a
            # scanned stack are zeroed again after the optimizer.
            _keep_updates(frozen)]
  return optax.chain(*chain), schedules


# --- models and initial weights ----------------------------------------------------------

def task_model(config: ModelConfig, task: str) -> nn.Module:
  if config.family != "bert":
    raise ValueError(f"fine-tuning needs a BERT model, got family={config.family!r}")
  if task == "token_classification":
    return BertForTokenClassification(config)
  return BertForSequenceClassification(config)


@dataclasses.dataclass
class Encoder:
  """Pre-trained encoder weights (the `bert` subtree, host arrays) and where they came from."""

  params: Any
  config: ModelConfig
  tokenizer: Path | None
  source: str


def _bert_subtree(params: Any, where: str) -> Any:
  params = nn.meta.unbox(params)
  if "bert" not in params:
    raise ValueError(f"{where}: no BERT encoder in these parameters (top-level keys: "
                     f"{', '.join(params)})")
  return jax.device_get(params["bert"])


def load_encoder(init_from: str | Path, step: int | None = None) -> Encoder:
  """The encoder of a params-only checkpoint (model.json), a fine-tuned OUT/best
  (finetune.json), a training workdir (checkpoints/) or a Hugging Face directory
  (config.json; BertForPreTraining / MaskedLM / Model / SequenceClassification / ...)."""
  from bertjax import hf
  source = Path(init_from)
  if (source / FINETUNE_FILE).is_file():
    params, config, _ = load_finetuned(source)
    return Encoder(_bert_subtree(params, str(source)), config,
                   checkpoint.tokenizer_dir(source), f"fine-tuned {source}")
  if (source / "model.json").is_file():
    params, config = checkpoint.load_params(source)
    return Encoder(_bert_subtree(params, str(source)), config,
                   checkpoint.tokenizer_dir(source), f"params {source}")
  if (source / "checkpoints").is_dir():
    return _workdir_encoder(source, step)
  if (source / "config.json").is_file():
    hf_config = json.loads((source / "config.json").read_text())
    config = hf.model_config_from_hf(hf_config)
    tensors = hf.read_safetensors(source)
    # A fine-tuned checkpoint's classifier is replaced by a fresh head.
    dropped = sorted(k for k in tensors if k.startswith("classifier."))
    tensors = {k: v for k, v in tensors.items() if k not in dropped}
    fresh = jit_init(BertForPreTraining(config))(jax.random.key(0))
    params, _, _ = hf.from_hf_state_dict(tensors, config, hf_config["model_type"], fresh)
    if dropped:
      log.info("%s: dropped the checkpoint's head (%s)", source, ", ".join(dropped))
    tokenizer = source if any((source / f).is_file() for f in ("vocab.txt", "spm.model")) \
        else None
    return Encoder(_bert_subtree(params, str(source)), config, tokenizer, f"hf {source}")
  raise ValueError(f"init_from={init_from}: neither a params-only checkpoint (model.json), a "
                   "training workdir (checkpoints/) nor a Hugging Face directory (config.json)")


def _workdir_encoder(workdir: Path, step: int | None) -> Encoder:
  from bertjax.train_checkpoint import run_params
  params, config, tokenizer, step = run_params(workdir, step)
  return Encoder(_bert_subtree(params, str(workdir)), config, tokenizer,
                 f"workdir {workdir} step {step}")


def load_finetuned(directory: str | Path, shardings: Any = None
                   ) -> tuple[Any, ModelConfig, dict[str, Any]]:
  """(params, model config, finetune.json) of a fine-tuned OUT/best directory."""
  directory = Path(directory).absolute()
  info = json.loads((directory / FINETUNE_FILE).read_text())
  model = task_model(checkpoint.load_model_config(directory), info["task"])
  abstract = nn.meta.unbox(jax.eval_shape(lambda r: init_params(model, r), jax.random.key(0)))
  params, config = checkpoint.load_params(directory, shardings, abstract=abstract)
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

def _loss_and_outputs(task: str, logits: jax.Array, labels: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
  """(mean loss, predictions)."""
  if task == "regression":
    preds = logits[:, 0]
    return jnp.mean((preds - labels) ** 2), preds
  preds = jnp.argmax(logits, -1).astype(jnp.int32)
  if task == "token_classification":
    valid = labels != labeled.IGNORE
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    return jnp.sum(ce * valid) / jnp.maximum(jnp.sum(valid), 1), preds
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), preds


def _train_step(state: TrainState, batch: dict, *, model, task, optimizer, schedule, rules):
  with nn.logical_axis_rules(rules):
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def loss_fn(params):
      logits = model.apply({"params": params}, batch["input_ids"], batch["token_type_ids"],
                           batch["attention_mask"], deterministic=False,
                           rngs={"dropout": key})
      return _loss_and_outputs(task, logits, batch["labels"])[0]

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
  metrics = {"loss": loss, "grad_norm": optax.global_norm(grads),
             "learning_rate": schedule(state.step)}
  return TrainState(state.step + 1, params, opt_state, state.rng), metrics


def _predict(params, batch, *, model, task, rules):
  with nn.logical_axis_rules(rules):
    logits = model.apply({"params": params}, batch["input_ids"], batch["token_type_ids"],
                         batch["attention_mask"], deterministic=True)
    return _loss_and_outputs(task, logits, batch["labels"])[1]


def _put(arrays: dict[str, np.ndarray], shardings: dict[str, NamedSharding]) -> dict:
  """Host arrays (every process holds all rows) -> global arrays in `shardings`."""
  return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
          for k, v in arrays.items()}


def _put_like(host: Any, sharding_: NamedSharding, like: jax.Array) -> jax.Array:
  """A host array (every process holds it whole) in `like`'s dtype, laid out in `sharding_`."""
  host = np.asarray(host, like.dtype)
  return jax.make_array_from_callback(like.shape, sharding_, lambda idx: host[idx])


def _rows(data: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, np.ndarray]:
  return {k: v[idx] for k, v in data.items() if k != "word_index"}


def _evaluate(predict, params, data: dict[str, np.ndarray], batch_size: int, shardings,
              task: str, label_names: Sequence[str]) -> dict[str, float]:
  n = len(data["labels"])
  preds = []
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size) % n  # the last batch padded with repeats
    out = predict(params, _put(_rows(data, idx), shardings))
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      out = multihost_utils.process_allgather(out, tiled=True)
    preds.append(np.asarray(jax.device_get(out))[:min(batch_size, n - start)])
  return task_metrics(task, data["labels"], np.concatenate(preds), label_names)


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
    encoder = load_encoder(init_from, spec.step)
  elif spec.model is not None:
    encoder = Encoder(None, spec.model, None, "random init")
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
  model = task_model(config, spec.task)
  if is_main and (note := recipe_note(spec, config.hidden_size)):
    log.warning("%s", note)

  # Mesh, shardings, parameters.
  mesh = mesh or sharding.make_mesh(dict(spec.mesh_axes))
  rules = sharding.resolve_rules(spec.rules)
  eval_batch = spec.eval_batch_size or spec.batch_size
  data_parallel = sharding.batch_ways(mesh, rules)
  for name, size in (("batch_size", spec.batch_size), ("eval_batch_size", eval_batch)):
    if size % data_parallel:
      raise ValueError(f"{name}={size} is not divisible by the {data_parallel} "
                       "data-parallel devices of the mesh")
  rng = jax.random.key(spec.seed)
  init_rng, dropout_rng = jax.random.split(rng)
  with jax.set_mesh(mesh):
    params, param_sh = sharding.sharded_init(lambda r: init_params(model, r), init_rng, mesh,
                                             rules)
    if encoder.params is not None:
      _check_encoder(encoder, params["bert"])
      params = {**params, "bert": jax.tree.map(_put_like, encoder.params, param_sh["bert"],
                                               params["bert"])}

  steps_per_epoch = math.ceil(len(train["labels"]) / spec.batch_size)
  total_steps = max(1, round(spec.epochs * steps_per_epoch))
  optimizer, schedules = build_optimizer(spec, params, config.num_layers, total_steps)
  abstract_opt = jax.eval_shape(optimizer.init, params)
  opt_sh = optimizer_state_shardings(abstract_opt, param_sh, params, mesh)
  replicated = NamedSharding(mesh, PartitionSpec())
  state_sh = TrainState(replicated, param_sh, opt_sh, replicated)
  with jax.set_mesh(mesh):
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
  state = TrainState(jax.device_put(jnp.zeros((), jnp.int32), replicated), params, opt_state,
                     jax.device_put(jax.random.key_data(dropout_rng), replicated))

  example = _rows(train, np.arange(spec.batch_size) % len(train["labels"]))
  train_sh = batch_shardings(example, mesh, rules)
  eval_sh = batch_shardings(_rows(dev, np.arange(eval_batch) % len(dev["labels"])), mesh,
                            rules)
  step_fn = jax.jit(functools.partial(_train_step, model=model, task=spec.task,
                                      optimizer=optimizer, schedule=schedules["pretrained"],
                                      rules=rules),
                    in_shardings=(state_sh, train_sh), out_shardings=(state_sh, None),
                    donate_argnums=(0,))
  predict = jax.jit(functools.partial(_predict, model=model, task=spec.task, rules=rules),
                    in_shardings=(param_sh, eval_sh))
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
        state, step_metrics = step_fn(state, _put(_rows(train, idx), train_sh))
        step += 1
        if spec.log_every and step % spec.log_every == 0:
          train_loss.append(float(step_metrics["loss"]))
          log.info("step %d/%d loss %.4f lr %.3g", step, total_steps, train_loss[-1],
                   float(step_metrics["learning_rate"]))
        end_of_epoch = b == steps_per_epoch - 1 or step == total_steps
        due = (step % spec.eval_every == 0) if spec.eval_every else end_of_epoch
        if not (due or step == total_steps):
          continue
        scores = _evaluate(predict, state.params, dev, eval_batch, eval_sh, spec.task,
                           label_names)
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
