"""Fine-tuning as a workload of the training loop: pre-trained weights on a task (the registry
and readers of bertjax.finetune), the dev set scored at every evaluation, the best parameters
kept, an early stop, and the task's products at the end.

Before the run the config is resolved (`resolve`): the model is the one of `init_from` with the
task's head (a BERT starts from its encoder under a fresh head; a GPT keeps its tied LM head),
and the steps follow from `finetune.epochs`. What this run adds (the best score, the
evaluations, the best parameters) is checkpointed, so a killed fine-tune resumes exactly.

The guide: docs/finetuning.md, 'A fine-tune is a run of the training loop'.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from etils import epath

from bertjax import hf, paths
from bertjax.checkpoints import exports
from bertjax.checkpoints.params import save_params, tokenizer_dir
from bertjax.checkpoints.weights import FINETUNE_FILE, Weights, describe_weights
from bertjax.config import model_config
from bertjax.data.rows import EpochBatches
from bertjax.data.tokenizers import load_tokenizer
from bertjax.finetune import registry, tasks
from bertjax.models import ModelConfig, families, peft
from bertjax.parallel import distributed, sharding
from bertjax.training import hooks
from bertjax.training.metrics import MetricsWriter
from bertjax.training.trainer import Trainer, TrainState

log = logging.getLogger(__name__)

# The model options a fine-tuning config sets over the weights' own (bertjax.models.peft).
ADAPTATION = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "adapter_size",
              "prefix_length")
_MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
# Below this width the paper's rate (tuned for BERT-base/large) barely moves the weights in a
# few epochs: the README's tiny BERT stays at chance with it (docs/finetuning.md).
_SMALL_MODEL_WIDTH = 512
_PAPER_LEARNING_RATE = 2e-5
SUMMARY_FILE = "finetune_summary.json"


def recipe_note(learning_rate: float, hidden_size: int) -> str | None:
  """A hint when a small model is fine-tuned at BERT-base's default learning rate, else None."""
  if hidden_size >= _SMALL_MODEL_WIDTH or learning_rate != _PAPER_LEARNING_RATE:
    return None
  return (f"learning rate {learning_rate:g} is BERT-base's recipe; a {hidden_size}-wide "
          "model may stay near chance with it: try e.g. --learning-rate 1e-3 --epochs 10 "
          "(docs/finetuning.md)")


def _lowercase(value: str, tokenizer_path: str | paths.PathLike) -> bool | None:
  """finetune.lowercase ("true"/"false"), else a Hugging Face tokenizer_config.json's
  do_lower_case (cased checkpoints), else None (the tokenizer's default)."""
  text = str(value).strip().lower()
  if text in ("true", "false"):
    return text == "true"
  if text:
    raise ValueError(f"finetune.lowercase={value!r}: expected true, false or empty")
  config = paths.path(tokenizer_path) / "tokenizer_config.json"
  if config.is_file():
    value = json.loads(config.read_text()).get("do_lower_case")
    return None if value is None else bool(value)
  return None


class FineTuning:
  """A fine-tuning run of `config` (finetune.task set) in `workdir` (OUT)."""

  checkpoint_items = ("run", "best")

  def __init__(self, config: ml_collections.ConfigDict, workdir: epath.Path, is_main: bool):
    self.workdir, self.is_main = workdir, is_main
    ft = config.finetune
    self.task = registry.task(ft.task)
    for key in ("train", "dev"):
      if not ft[key]:
        raise ValueError(f"--config.finetune.{key} is empty: fine-tuning needs {key} examples")
    checkpoints = workdir / "checkpoints"
    resumable = checkpoints.exists() and any(p.name.isdigit() for p in checkpoints.iterdir())
    if (workdir / "best").exists() and not resumable:
      raise FileExistsError(f"{workdir / 'best'} already exists and {workdir} holds no "
                            "checkpoint to resume; choose a new output directory")
    self.start = self._start_weights(config)
    model = self.start.config
    family = model.family_record
    if int(config.seq_length) > model.max_positions and not family.unbounded_positions:
      raise ValueError(f"seq_length={config.seq_length} exceeds the model's max_positions="
                       f"{model.max_positions} (a --recipe sets its paper's length; give "
                       "--seq-length)")
    if family.is_decoder and int(ft.max_new_tokens) >= model.max_positions:
      raise ValueError(f"max_new_tokens={ft.max_new_tokens} leaves no room for a prompt in the "
                       f"model's {model.max_positions} positions")
    if (family.is_encoder_decoder and not family.unbounded_positions
        and int(ft.target_length) > model.max_positions):
      raise ValueError(f"target_length={ft.target_length} exceeds the {model.family} model's "
                       f"{model.max_positions} decoder positions")
    self.tokenizer_path = ft.tokenizer or self.start.tokenizer
    if not self.tokenizer_path:
      raise ValueError(f"{self.start.source} ships no tokenizer: set finetune.tokenizer")
    # The tokenizer is the family's style (GPT's <|endoftext|>, T5's sentinels, BART's <s> and
    # <mask>).
    tokenizer = load_tokenizer(paths.local_copy(self.tokenizer_path),
                               _lowercase(ft.lowercase, self.tokenizer_path),
                               require=family.tokenizer_style)
    self.data = tasks.build(config, tokenizer)
    # The weights' own additions stay unless the config sets others (a LoRA OUT/best goes on
    # with its LoRA).
    changes = {k: config.model[k] for k in ADAPTATION if config.model[k] != _MODEL_DEFAULTS[k]}
    if float(ft.dropout) >= 0:
      changes.update(hidden_dropout=float(ft.dropout), attention_dropout=float(ft.dropout))
    model = model.replace(**self.data.model_changes, **changes)
    if model.has_generator:  # replaced-token detection: the discriminator is fine-tuned
      model = model.discriminator_config()
    if len(tokenizer) > model.vocab_size:
      raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                       f"only {model.vocab_size}")
    if is_main and family.is_encoder and (
        note := recipe_note(float(config.optimizer.learning_rate), model.hidden_size)):
      log.warning("%s", note)
    self.rows = len(next(iter(self.data.train.values())))
    self.steps_per_epoch = math.ceil(self.rows / int(config.batch_size))
    self.config = self._resolved(config, model)
    self.metric = ft.metric or self.data.metric or self.task.metric
    # What the loop checkpoints besides the train state ("run"), and the best parameters.
    self.best: dict[str, Any] = {"value": None, "step": 0, "epoch": 0.0}
    self.stale, self.stopped, self.history = 0, False, []
    self.best_params = None
    self._evaluated_step = -1
    self._started = time.perf_counter()

  def prepare(self) -> None:
    pass  # the task's rows were read with the config, which they resolve

  def _start_weights(self, config: ml_collections.ConfigDict) -> Weights:
    """What training starts from: `init_from`'s model config and tokenizer (the parameters are
    read when a new run initialises), or `config.model` at random."""
    if not config.init_from:
      return Weights(None, model_config(config), None, "random init")
    step = int(config.init_step)
    previous = self.workdir / "config.json"  # this run's, written when it last started
    if step < 0 and previous.exists():
      # A resumed fine-tune keeps the workdir step it started from, though the weights' run
      # may have saved later steps since.
      saved = json.loads(previous.read_text())
      if saved.get("init_from") == config.init_from and int(saved.get("init_step", -1)) >= 0:
        step = int(saved["init_step"])
    start = describe_weights(config.init_from, None if step < 0 else step)
    if start.config.family_record.kind != self.task.kind:
      needed = " or ".join(families.of_kind(self.task.kind))
      raise ValueError(f"{config.init_from}: a {start.config.family} model; task "
                       f"{config.finetune.task} needs a {needed} model")
    return start

  def _resolved(self, config: ml_collections.ConfigDict, model: Any) -> ml_collections.ConfigDict:
    """The run config with what the weights and the task decide filled in."""
    resolved = config.copy_and_resolve_references()
    ft = resolved.finetune
    total = max(1, round(float(ft.epochs) * self.steps_per_epoch))
    resolved.model = ml_collections.ConfigDict(dataclasses.asdict(model))
    resolved.objective = self.task.objective
    resolved.num_train_steps = total
    resolved.optimizer.warmup_steps = round(float(ft.warmup_fraction) * total)
    resolved.eval_every = int(config.eval_every) or self.steps_per_epoch
    if self.start.step is not None:
      resolved.init_step = self.start.step  # the workdir step read, whatever comes later
    return resolved

  def batches(self, phase_config: ml_collections.ConfigDict, rows: Sequence[int]
              ) -> EpochBatches:
    return EpochBatches(self.data.train, int(phase_config.batch_size),
                        int(phase_config.data.seed), rows)

  def initial_state(self, trainer: Trainer) -> TrainState:
    state = trainer.init_state(int(self.config.seed))
    if self.config.init_from:
      # A BERT's own heads make way for the task's fresh one; a GPT keeps its LM head.
      keep = ("bert",) if self.task.kind == "encoder" else ()
      state, _ = trainer.start_from(state, self.config.init_from, self.start.step, keep)
    log.info("fine-tuning %s from %s: %d train / %d dev examples (%d training rows), %d steps "
             "(%d per epoch), freeze %s", self.config.finetune.task, self.start.source,
             self.data.num_train, self.data.num_dev, self.rows, self.config.num_train_steps,
             self.steps_per_epoch, self.config.optimizer.freeze)
    return state

  def add_hooks(self, step_hooks: hooks.Hooks, trainer: Trainer, writer: MetricsWriter,
                train_metrics: hooks.TrainMetrics) -> None:
    try:  # the dev set's batches, checked before the first step rather than at an epoch's end
      sharding.check_batch(tasks.eval_batch_size(self.config), 1, trainer.mesh, trainer.rules)
    except ValueError as e:
      raise ValueError(f"finetune.eval_batch_size: {e}") from None

    def evaluate_dev(info: hooks.StepInfo) -> None:
      train_metrics.read_pending()
      train_loss = float(jax.device_get(info.metrics["loss"]))
      eval_start = time.perf_counter()
      scores = self.data.evaluate(trainer, info.state.params)
      if self.metric not in scores:
        raise ValueError(f"metric {self.metric!r} is not reported for "
                         f"{self.config.finetune.task} ({', '.join(scores)})")
      epoch = round(info.step / self.steps_per_epoch, 4)
      self.history.append({"step": info.step, "epoch": epoch, "train_loss": train_loss,
                           "elapsed_s": round(time.perf_counter() - self._started, 2),
                           **{f"dev_{k}": v for k, v in scores.items()}})
      writer.write(info.step, {"epoch": epoch, **scores}, prefix="dev")
      self._evaluated_step = info.step
      if _better(self.metric, scores[self.metric], self.best["value"]):
        self.best = {"value": scores[self.metric], "step": info.step, "epoch": epoch}
        self.best_params = jax.tree.map(jnp.copy, info.state.params)
        self.stale = 0
      else:
        self.stale += 1
        patience = int(self.config.finetune.patience)
        if patience and self.stale >= patience:
          log.info("early stop: %s has not improved for %d evaluations", self.metric,
                   self.stale)
          self.stopped = True
      train_metrics.exclude(time.perf_counter() - eval_start)

    step_hooks.add(evaluate_dev, every=int(self.config.eval_every), last=True, name="dev_eval",
                   category="evaluation")

  def evaluated_at(self, step: int) -> bool:
    return step == self._evaluated_step

  def saved(self, state: TrainState) -> dict[str, Any]:
    run = {"best": self.best, "stale": self.stale, "stopped": self.stopped,
           "history": self.history}
    # Before the first evaluation there are no best parameters: the current ones hold the place.
    return {"run": run, "best": self.best_params if self.best_params is not None
            else state.params}

  def restore(self, checkpoints: Any, step: int, trainer: Trainer) -> None:
    restored = checkpoints.restore_extra(step, trainer.abstract_state().params)
    run = restored["run"]
    self.best, self.stale = run["best"], int(run["stale"])
    self.stopped, self.history = bool(run["stopped"]), list(run["history"])
    self.best_params = restored["best"] if self.best["value"] is not None else None

  def finish(self, state: TrainState, trainer: Trainer, trained: bool) -> dict[str, Any]:
    """OUT/best, the task's final products (generations) and exports, and the summary. Done once
    for a run's end: OUT/finetune_summary.json marks it with the step and the config it is of,
    and a run started again returns it; outputs a kill interrupted, or of another step or
    config (a run continued to more epochs, with other exports), are written again whole."""
    out = self.workdir
    done = out / SUMMARY_FILE
    of = {"step": int(state.step), "config": _digest(self.config)}
    if done.exists() and not trained:
      summary = json.loads(done.read_text())
      if summary.get("of") == of:
        return summary
    distributed.barrier("finetune outputs checked")
    if self.is_main:
      for name in (SUMMARY_FILE, "generations.jsonl"):
        if (out / name).exists():
          (out / name).unlink()
      for name in ("best", "hf", "peft"):
        if (out / name).exists():
          (out / name).rmtree()
    distributed.barrier("finetune outputs cleared")
    params = self.best_params if self.best_params is not None else state.params
    best_dir, info = self._save_best(params)
    final = self.data.final(trainer, params, out) if self.data.final else {}
    hf_dir = peft_dir = None
    if self.config.finetune.export_hf:
      host = distributed.to_host(params)  # every process: the parameters may be spread
      if self.is_main:
        model = model_config(self.config)
        tokenizer = tokenizer_dir(best_dir)
        hf_dir = exports.task_hf(host, model, info, tokenizer, out / "hf")
        if info["base"] and model.lora_rank:
          peft_dir = exports.task_peft(host, model, info, out / "peft")
    summary = {"metric": self.metric, "best_value": self.best["value"],
               "best_step": self.best["step"], "best_epoch": self.best["epoch"],
               "steps": int(state.step), "total_steps": int(self.config.num_train_steps),
               "stopped_early": self.stopped, "labels": self.data.info.get("labels"),
               "history": self.history, "best_dir": str(best_dir),
               "hf_dir": str(hf_dir) if hf_dir else None,
               "peft_dir": str(peft_dir) if peft_dir else None, **final, "of": of}
    distributed.barrier("finetune outputs written")
    if self.is_main:
      done.write_text(json.dumps(summary, indent=2) + "\n")
    return summary

  def summary_lines(self, result: dict[str, Any]) -> list[str]:
    if "best_dir" not in result:  # stopped before the end (preempted): no products yet
      return []
    lines = [f"  best dev {result['metric']} {result['best_value']:.4f} at step "
             f"{result['best_step']} (epoch {result['best_epoch']:g})"
             + (", stopped early" if result["stopped_early"] else ""),
             f"  best parameters {result['best_dir']}"]
    for key, what in (("hf_dir", "Hugging Face"), ("peft_dir", "peft adapter"),
                      ("generations", "generations")):
      if result.get(key):
        lines.append(f"  {what} {result[key]}")
    return lines

  def _save_best(self, params: Any) -> tuple[epath.Path, dict[str, Any]]:
    """OUT/best: the parameters (with freeze=base and a base checkpoint, only the trained
    ones: the additions and the head), finetune.json and the tokenizer; and finetune.json's
    contents."""
    config, init_from = self.config, self.config.init_from
    base = None
    if config.optimizer.freeze == "base" and init_from and peft.has_additions(params):
      params = peft.trainable_params(params, config.optimizer.freeze)
      base = str(init_from) if paths.is_remote(init_from) else str(Path(init_from).absolute())
    # The model as configured, not as resolved for this platform's kernels.
    best_dir = save_params(self.workdir / "best", params, model_config(config))
    info = {"task": config.finetune.task, **self.data.info, "metric": self.metric,
            "best": self.best, "seq_length": int(config.seq_length),
            "freeze": config.optimizer.freeze, "init_from": init_from or None, "base": base,
            "base_step": self.start.step if base else None}
    if self.is_main:
      source = paths.path(self.tokenizer_path)
      if source.is_file():
        (best_dir / "tokenizer").mkdir(parents=True, exist_ok=True)
        (best_dir / "tokenizer" / source.name).write_bytes(source.read_bytes())
      elif (source / "config.json").exists():  # a Hugging Face directory: its tokenizer only
        (best_dir / "tokenizer").mkdir(parents=True, exist_ok=True)
        hf.copy_tokenizer_files(source, best_dir / "tokenizer")
      else:
        paths.copy_tree(source, best_dir / "tokenizer")
      # Written last: a directory with finetune.json is a whole fine-tuned output.
      (best_dir / FINETUNE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return best_dir, info


def _better(metric: str, value: float, best: float | None) -> bool:
  if best is None:
    return True
  return value < best if metric in registry.LOWER_IS_BETTER else value > best


def _digest(config: ml_collections.ConfigDict) -> str:
  return hashlib.sha256(config.to_json_best_effort(sort_keys=True).encode()).hexdigest()[:16]
