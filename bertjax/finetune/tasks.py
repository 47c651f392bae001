"""What each fine-tuning task reads, trains on and is scored by (`build`): the rows the one
trainer steps over and the dev evaluation. The facts about each task are the registry's
(bertjax.finetune.registry); the readers are bertjax.finetune.labeled (classification,
regression, token_classification), bertjax.finetune.squad (question_answering) and
bertjax.finetune.completions (completion).

A `TaskData` holds the training rows (every field [N, ...], host arrays) and the functions the
training loop calls (bertjax.training.finetuning); nothing here steps or saves. The settings
come from the run config: its `finetune` group, `seq_length` and `batch_size`.

The guide: docs/finetuning.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding

from bertjax import paths
from bertjax.data.errors import CorpusError
from bertjax.data.seq2seq import specials
from bertjax.finetune import completions, labeled, scores, squad, text_to_text
from bertjax.hf.tokenizer import fast_tokenizer
from bertjax.inference import generate
from bertjax.parallel.distributed import to_host

log = logging.getLogger(__name__)


class Trainer(Protocol):
  """What a task's evaluation needs of the trainer (bertjax.training.trainer.Trainer)."""

  batch_shardings: Mapping[str, NamedSharding]

  def predict(self, params: Any, batch: Mapping[str, jax.Array]) -> jax.Array: ...

  def evaluate(self, params: Any, batch: Mapping[str, jax.Array]) -> dict: ...

Rows = dict[str, np.ndarray]


@dataclasses.dataclass
class TaskData:
  # Training rows: every field [N, ...]; one row per example (a window for QA, a packed row
  # of several examples for completion).
  train: Rows
  # Counts for the log: training / dev examples.
  num_train: int
  num_dev: int
  # (trainer, params) -> dev scores by name.
  evaluate: Callable[[Trainer, Any], dict[str, float]]
  # ModelConfig changes the task needs (a classifier's num_labels).
  model_changes: dict[str, Any]
  # What finetune.json records about the task (labels, preprocessing settings).
  info: dict[str, Any]
  # (trainer, best params, OUT) -> summary, run once after training (generations).
  final: Callable[[Trainer, Any, paths.PathLike], dict[str, Any]] | None = None
  # The dev metric that selects, where the data decide it (text-to-text); else the registry's.
  metric: str | None = None


def put(arrays: Rows, shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
  """Host arrays (every process holds all rows) -> global arrays in `shardings`."""
  return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
          for k, v in arrays.items()}


def take(rows: Rows, idx: np.ndarray) -> Rows:
  return {k: v[idx] for k, v in rows.items()}


def predict_rows(trainer: Trainer, params: Any, rows: Rows, batch_size: int) -> np.ndarray:
  """The objective's `predict` over every row, in order (the last batch padded with repeats
  and trimmed)."""
  n = len(next(iter(rows.values())))
  preds = []
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size) % n
    out = trainer.predict(params, put(take(rows, idx), trainer.batch_shardings))
    preds.append(np.asarray(to_host(out))[:min(batch_size, n - start)])
  return np.concatenate(preds)


def lm_loss_over_rows(trainer: Trainer, params: Any, rows: Rows, batch_size: int
                      ) -> dict[str, float]:
  """The token-weighted mean LM loss over every row (each batch's mean times its loss tokens;
  the last batch padded with rows that carry no loss) and its perplexity."""
  n = len(rows["loss_mask"])
  total, tokens = 0.0, 0.0
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size) % n
    batch = take(rows, idx)
    batch["loss_mask"] = np.where((np.arange(start, start + batch_size) < n)[:, None],
                                  batch["loss_mask"], 0).astype(batch["loss_mask"].dtype)
    count = float(batch["loss_mask"].sum())
    if count == 0:
      continue
    metrics = trainer.evaluate(params, put(batch, trainer.batch_shardings))
    total += float(metrics["lm_loss"]) * count
    tokens += count
  loss = total / max(tokens, 1.0)
  return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": tokens}


def eval_batch_size(config: ml_collections.ConfigDict) -> int:
  return int(config.finetune.eval_batch_size) or int(config.batch_size)


# --- labelled tasks ------------------------------------------------------------------------

def labelled(config: ml_collections.ConfigDict, tokenizer: Any) -> TaskData:
  ft = config.finetune
  seq_length = int(config.seq_length)
  columns = labeled.Columns(ft.text_a, ft.text_b or None, ft.label, ft.tokens, ft.tags)

  def read(path: str) -> list[labeled.Example]:
    return labeled.read_examples(paths.local_copy(path), ft.task, columns,
                                 header=bool(ft.header))

  def encoded(examples: list[labeled.Example]) -> Rows:
    rows = labeled.encode(examples, tokenizer, seq_length, label_names, ft.task)
    rows.pop("word_index", None)
    return rows

  def scored(trainer: Trainer, params: Any, rows: Rows) -> dict[str, float]:
    preds = predict_rows(trainer, params, rows, eval_batch_size(config))
    return scores.task_scores(ft.task, rows["labels"], preds, label_names)

  train_examples, dev_examples = read(ft.train), read(ft.dev)
  label_names = labeled.label_vocabulary(train_examples, ft.task)
  num_labels = 1 if ft.task == "regression" else len(label_names)
  if int(ft.num_labels) and int(ft.num_labels) != num_labels:
    raise ValueError(f"num_labels={ft.num_labels} but {ft.train} has {num_labels} "
                     f"label(s): {', '.join(label_names)}")
  if num_labels < 1 or (ft.task != "regression" and num_labels < 2):
    raise ValueError(f"{ft.train}: {num_labels} distinct label(s); classification needs 2+")
  train, dev = encoded(train_examples), encoded(dev_examples)
  second = encoded(read(ft.second_dev)) if ft.get("second_dev") else None

  def evaluate(trainer: Trainer, params: Any) -> dict[str, float]:
    result = scored(trainer, params, dev)
    if second is not None:
      result.update({f"second_{name}": value
                     for name, value in scored(trainer, params, second).items()})
    return result

  return TaskData(train, len(train_examples), len(dev_examples), evaluate,
                  {"num_labels": num_labels},
                  {"labels": label_names, "text_b": bool(ft.text_b)})


# --- extractive question answering ---------------------------------------------------------

def question_answering(config: ml_collections.ConfigDict, tokenizer: Any) -> TaskData:
  ft = config.finetune
  fast = fast_tokenizer(tokenizer)  # offsets, and exactly bertjax's ids
  seq_length, doc_stride = int(config.seq_length), int(ft.doc_stride)
  settings = dict(max_seq_length=seq_length, doc_stride=doc_stride,
                  max_query_length=int(ft.max_query_length))
  # Context tokens per window beside the longest question.
  window = seq_length - int(ft.max_query_length) - 3
  if doc_stride >= window:
    log.warning("doc_stride=%d >= the %d context tokens of a window: windows do not overlap, "
                "and an answer across a window edge is in none; try doc_stride %d",
                doc_stride, window, max(1, window // 2))
  train_examples = squad.read_squad(paths.local_copy(ft.train))
  dev_examples = squad.read_squad(paths.local_copy(ft.dev))
  train = squad.build_features(train_examples, fast, **settings)
  dev = squad.build_features(dev_examples, fast, **settings)
  version_2 = any(e.is_impossible for e in train_examples + dev_examples)

  def evaluate(trainer: Trainer, params: Any) -> dict[str, float]:
    logits = predict_rows(trainer, params, dev.batch(), eval_batch_size(config))
    answers = squad.postprocess(dev_examples, dev, logits, n_best=int(ft.n_best),
                                max_answer_length=int(ft.max_answer_length),
                                version_2=version_2, null_threshold=float(ft.null_threshold))
    return scores.squad_scores({k: v["answer"] for k, v in answers.items()}, dev_examples)

  return TaskData(train.batch(), len(train_examples), len(dev_examples), evaluate, {},
                  {"version_2": version_2, "doc_stride": doc_stride,
                   "max_query_length": int(ft.max_query_length),
                   "max_answer_length": int(ft.max_answer_length), "n_best": int(ft.n_best),
                   "null_threshold": float(ft.null_threshold), "train_windows": len(train),
                   "dev_windows": len(dev)})


# --- GPT on prompts and completions --------------------------------------------------------

def completion(config: ml_collections.ConfigDict, tokenizer: Any) -> TaskData:
  ft = config.finetune
  train = completions.load_completions(paths.local_copy(ft.train), tokenizer,
                                       int(config.seq_length))
  dev = completions.load_completions(paths.local_copy(ft.dev), tokenizer, int(config.seq_length))

  def evaluate(trainer: Trainer, params: Any) -> dict[str, float]:
    result = lm_loss_over_rows(trainer, params, dev.rows, eval_batch_size(config))
    return {"loss": result["loss"], "perplexity": result["perplexity"]}

  def final(trainer: Trainer, params: Any, out: paths.PathLike) -> dict[str, Any]:
    """Greedy generations of the dev file's first prompts, from exactly the tokens training
    puts before a completion, to <|endoftext|>."""
    records = completions.read_completion_records(paths.local_copy(ft.dev))[
        :int(ft.generate_examples)]
    max_new_tokens = int(ft.max_new_tokens)
    if not records or not max_new_tokens:
      return {}
    out = paths.path(out)
    held_out = [completions.held_out_example(r, tokenizer) for r in records]
    keep = trainer.model_config.max_positions - max_new_tokens  # > 0: checked up front
    eot = tokenizer.eot_id
    params = to_host(params)  # on every process: the parameters may be spread over processes
    if jax.process_index() != 0:
      return {"generations": str(out / "generations.jsonl")}
    new = generate.generate(params, trainer.model_config,
                            [list(h.prompt_ids)[max(0, len(h.prompt_ids) - keep):]
                             for h in held_out],
                            max_new_tokens=max_new_tokens, stop_tokens=(eot,))
    lines = [{"where": h.where, "prompt": h.prompt, "reference": h.completion,
              "generated": generate.continuation_text(tokenizer, list(h.prompt_ids),
                                                      [t for t in ids if t != eot])}
             for h, ids in zip(held_out, new)]
    (out / "generations.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return {"generations": str(out / "generations.jsonl")}

  log.info("completion data: %d train examples in %d rows (%d loss tokens), %d dev examples "
           "in %d rows", train.examples, len(train.rows["input_ids"]), train.loss_tokens,
           dev.examples, len(dev.rows["input_ids"]))
  return TaskData(train.rows, train.examples, dev.examples, evaluate, {},
                  {"truncated": train.truncated + dev.truncated,
                   "skipped": train.skips.summary() if train.skips.counts else ""},
                  final)


# --- T5 and BART, text to text ------------------------------------------------------------

def text_to_text_task(config: ml_collections.ConfigDict, tokenizer: Any) -> TaskData:
  ft = config.finetune
  seq_length, target_length = int(config.seq_length), int(ft.target_length)
  frame = specials(tokenizer)
  need = 2 + (frame.bos is not None)  # T5's </s> or BART's <s> and </s>, and a token
  for name, length in (("seq_length", seq_length), ("target_length", target_length)):
    if length < need:
      raise ValueError(f"{name}={length}: a text needs its {need - 1} special token(s) and a "
                       "token")
  train_path, dev_path = Path(paths.local_copy(ft.train)), Path(paths.local_copy(ft.dev))
  kind, dev_kind = text_to_text.format_of(train_path), text_to_text.format_of(dev_path)
  if dev_kind != kind:
    raise CorpusError(f"{dev_path}: {dev_kind} data, but {train_path} is {kind} data")
  examples = {name: text_to_text.read_examples(path, kind, ft)
              for name, path in (("train", train_path), ("dev", dev_path))}
  encoded = {name: text_to_text.encode(e, tokenizer, frame, seq_length, target_length)
             for name, e in examples.items()}
  for name, enc in encoded.items():
    if enc.cut_sources or enc.cut_targets:
      log.warning("text_to_text %s: %d of %d inputs cut to seq_length=%d, %d targets to "
                  "target_length=%d", name, enc.cut_sources, len(examples[name]), seq_length,
                  enc.cut_targets, target_length)
  rows = {name: text_to_text.pack(enc, seq_length, target_length, frame)
          for name, enc in encoded.items()}
  dev_examples = examples["dev"]

  def dev_generations(trainer: Trainer, params: Any) -> list[str]:
    host = to_host(params)  # every process: the parameters may be spread over processes
    return text_to_text.generate_texts(host, trainer.model_config, tokenizer, frame,
                                       encoded["dev"].sources, eval_batch_size(config),
                                       seq_length, target_length)

  def evaluate(trainer: Trainer, params: Any) -> dict[str, float]:
    result = text_to_text.score(kind, dev_examples, dev_generations(trainer, params))
    loss = lm_loss_over_rows(trainer, params, rows["dev"], eval_batch_size(config))
    return {**result, "loss": loss["loss"]}

  def final(trainer: Trainer, params: Any, out: paths.PathLike) -> dict[str, Any]:
    """Every dev example's greedy generation beside its references (OUT/generations.jsonl)."""
    generated = dev_generations(trainer, params)
    path = paths.path(out) / "generations.jsonl"
    if jax.process_index() == 0:
      path.write_text("".join(
          json.dumps({"id": e.id, "input": e.source, "references": list(e.answers),
                      "generated": g}) + "\n" for e, g in zip(dev_examples, generated)))
    return {"generations": str(path)}

  log.info("text_to_text (%s): %d train examples in %d rows, %d dev examples in %d rows",
           kind, len(examples["train"]), len(rows["train"]["input_ids"]), len(dev_examples),
           len(rows["dev"]["input_ids"]))
  cut = {f"{name}_{side}": getattr(enc, f"cut_{side}") for name, enc in encoded.items()
         for side in ("sources", "targets")}
  return TaskData(rows["train"], len(examples["train"]), len(dev_examples), evaluate, {},
                  {"format": kind, "target_length": target_length, "cut": cut}, final,
                  metric=text_to_text.FORMATS[kind])


def build(config: ml_collections.ConfigDict, tokenizer: Any) -> TaskData:
  """The data of the run's task (`finetune.task`), read from `finetune.train` and `.dev`."""
  name = config.finetune.task
  if name == "question_answering":
    return question_answering(config, tokenizer)
  if name == "completion":
    return completion(config, tokenizer)
  if name == "text_to_text":
    return text_to_text_task(config, tokenizer)
  return labelled(config, tokenizer)
