"""Few-shot evaluation of a GPT without training, as GPT-3 (Brown et al. 2020): `evaluate_fewshot`
predicts the label whose verbalisation (default: the label itself) the model finds most likely
after k demonstrations and the query.

`Template`: a demonstration is "{text}\\nAnswer:" + " {label}" + "\\n\\n", the query
"{text}\\nAnswer:", each candidate " {label}". Per query one seeded draw orders the pool without
the query's text, and k shots are its first k. A candidate's score is its summed
log-probability (also length-normalised).

The guide: docs/finetuning.md, 'Few-shot evaluation of a GPT'.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.data.errors import CorpusError
from bertjax.finetune import labeled
from bertjax.finetune.completions import split_encode
from bertjax.models import ModelConfig, build_model

Array = jax.Array
SAMPLING = ("random", "balanced")


@dataclasses.dataclass(frozen=True)
class Template:
  """How demonstrations and the query are written; each part can be overridden."""

  query: str = "{text}\nAnswer:"
  answer: str = " {label}"
  separator: str = "\n\n"

  def demonstration(self, text: str, verbalisation: str) -> str:
    return (self.query.replace("{text}", text) + self.answer.replace("{label}", verbalisation)
            + self.separator)

  def prompt(self, text: str, demonstrations: Sequence[tuple[str, str]]) -> str:
    """The prompt for query `text` after (text, verbalisation) demonstrations, in order."""
    return "".join(self.demonstration(t, v) for t, v in demonstrations) + \
        self.query.replace("{text}", text)

  def candidate(self, verbalisation: str) -> str:
    return self.answer.replace("{label}", verbalisation)


@dataclasses.dataclass(frozen=True)
class Labelled:
  """A text and its label; `where` ("file:line") names it in errors."""

  text: str
  label: str
  where: str = ""


def read_labelled(path: str | Path, text_column: str = "sentence",
                  label_column: str = "label") -> list[Labelled]:
  """Labelled texts of a TSV/CSV/JSONL file with named columns (bertjax.finetune.labeled)."""
  examples = labeled.read_examples(
      path, "classification", labeled.Columns(text_a=text_column, label=label_column))
  return [Labelled(e.text_a, str(e.label), e.where) for e in examples]


def _as_labelled(data: str | Path | Sequence[Any], text_column: str,
                 label_column: str) -> list[Labelled]:
  if isinstance(data, (str, Path)):
    return read_labelled(data, text_column, label_column)
  out = []
  for i, item in enumerate(data):
    if isinstance(item, Labelled):
      out.append(item)
    elif isinstance(item, labeled.Example):
      out.append(Labelled(item.text_a, str(item.label), item.where))
    else:
      text, label = item
      out.append(Labelled(str(text), str(label), f"example {i}"))
  return out


def demonstration_order(pool: Sequence[Labelled], query: Labelled, count: int,
                        rng: random.Random, sampling: str = "random",
                        labels: Sequence[str] | None = None) -> list[int]:
  """Indices of up to `count` pool examples, the query's text excluded, in draw order."""
  allowed = [i for i, e in enumerate(pool) if e.text != query.text]
  if sampling == "random":
    return rng.sample(allowed, min(count, len(allowed)))
  if sampling != "balanced":
    raise ValueError(f"sampling must be one of {', '.join(SAMPLING)}, got {sampling!r}")
  by_label: dict[str, list[int]] = collections.defaultdict(list)
  for i in allowed:
    by_label[pool[i].label].append(i)
  classes = [c for c in (labels or sorted(by_label)) if by_label[c]]
  rng.shuffle(classes)
  queues = {c: rng.sample(by_label[c], min(count, len(by_label[c]))) for c in classes}
  order: list[int] = []
  while len(order) < count and any(queues.values()):
    for c in classes:
      if queues[c] and len(order) < count:
        order.append(queues[c].pop(0))
  return order


# --- scoring -----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config",))
def _summed_log_probs(params: Any, ids_BL: Array, targets_BL: Array, weights_BL: Array,
                      mask_BL: Array, *, config: ModelConfig) -> Array:
  """Σ over weighted slots of log p(target | inputs so far), per row [B]."""
  logits_BLV = build_model(config).apply({"params": params}, ids_BL, attention_mask_BL=mask_BL)
  log_probs_BLV = jax.nn.log_softmax(logits_BLV.astype(jnp.float32), axis=-1)
  picked_BL = jnp.take_along_axis(log_probs_BLV, targets_BL[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(weights_BL > 0, picked_BL, 0.0), axis=-1)


def score_continuations(params: Any, model_config: ModelConfig,
                        pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                        batch_size: int = 16, bucket: int = 32, pad_id: int = 0) -> np.ndarray:
  """Σ log p(continuation tokens | context tokens) for each (context, continuation) pair
  (float32 [N]). Rows are right-padded to a multiple of `bucket` (at most the model's
  positions) and run `batch_size` at a time, so each length bucket compiles once."""
  if not model_config.is_decoder:
    raise ValueError(f"few-shot scoring needs a GPT model, got family={model_config.family!r}")
  limit = model_config.max_positions
  config = model_config.replace(hidden_dropout=0.0, attention_dropout=0.0)
  lengths = []
  for i, (context, continuation) in enumerate(pairs):
    if not context or not continuation:
      raise ValueError(f"pair {i}: context and continuation need at least one token each")
    if len(context) + len(continuation) > limit:
      raise ValueError(f"pair {i}: {len(context) + len(continuation)} tokens exceed the "
                       f"model's {limit} positions")
    lengths.append(len(context) + len(continuation))
  out = np.zeros(len(pairs), np.float32)
  by_bucket: dict[int, list[int]] = collections.defaultdict(list)
  for i, n in enumerate(lengths):
    by_bucket[min(-(-n // bucket) * bucket, limit)].append(i)
  for length, members in sorted(by_bucket.items()):
    for start in range(0, len(members), batch_size):
      chunk = members[start:start + batch_size]
      ids = np.full((batch_size, length), pad_id, np.int32)
      targets = np.full((batch_size, length), pad_id, np.int32)
      weights = np.zeros((batch_size, length), np.int32)
      mask = np.zeros((batch_size, length), np.int32)
      for b, i in enumerate(chunk):
        context, continuation = pairs[i]
        row = list(context) + list(continuation)
        ids[b, :len(row)] = row
        targets[b, :len(row) - 1] = row[1:]
        # Slot t predicts token t + 1: the continuation's tokens are predicted from slots
        # len(context) - 1 ... len(row) - 2.
        weights[b, len(context) - 1:len(row) - 1] = 1
        mask[b, :len(row)] = 1
      sums = _summed_log_probs(params, jnp.asarray(ids), jnp.asarray(targets),
                               jnp.asarray(weights), jnp.asarray(mask), config=config)
      out[chunk] = np.asarray(sums)[:len(chunk)]
  return out


# --- evaluation --------------------------------------------------------------------------


def _fit_prompt(template: Template, tokenizer: Any, text: str,
                demonstrations: Sequence[tuple[str, str]], candidates: Sequence[str],
                limit: int, stats: collections.Counter) -> tuple[str, list, int]:
  """The prompt for `text` after as many `demonstrations` ((text, verbalisation) in draw
  order, the first drawn nearest the query) as fit in `limit` tokens with every candidate, the
  last drawn dropped first (counted in stats["dropped_demonstrations"]); returns the prompt,
  its encoded (prompt, candidate) rows and the number of demonstrations kept. Without any
  demonstration the rows are returned whatever their length."""
  chosen = list(demonstrations)
  while True:
    prompt = template.prompt(text, chosen[::-1])
    rows = [split_encode(tokenizer, prompt, template.candidate(c)) for c in candidates]
    if max(len(p) + len(c) for p, c in rows) <= limit or not chosen:
      return prompt, rows, len(chosen)
    chosen = chosen[:-1]
    stats["dropped_demonstrations"] += 1


def evaluate_fewshot(params: Any, model_config: ModelConfig, tokenizer: Any,
                     examples: str | Path | Sequence[Any], *,
                     pool: str | Path | Sequence[Any] | None = None,
                     ks: Sequence[int] = (0, 1, 4, 8),
                     verbalisations: Mapping[str, str] | None = None,
                     template: Template = Template(), sampling: str = "random", seed: int = 0,
                     text_column: str = "sentence", label_column: str = "label",
                     max_length: int | None = None, batch_size: int = 16, bucket: int = 32,
                     return_prompts: bool = False) -> dict[str, Any]:
  """Few-shot accuracy of a GPT on labelled `examples` for each k in `ks` (docs/finetuning.md).

  `examples` and `pool` (where demonstrations come from; default: `examples`, the query
  excluded) are a TSV/CSV/JSONL path with `text_column` and `label_column`, or a sequence of
  `Labelled`, `labeled.Example` or (text, label). Returns
  {"by_k": {k: {"accuracy", "accuracy_length_normalised", "correct", "n", "predicted" (label ->
  count), "demonstrations" (mean used), "dropped_demonstrations", "shortened_prompts",
  "truncated_queries"}}, "majority_label", "majority_baseline", "chance_baseline", "labels",
  "verbalisations", "n", "sampling", "seed"}, and with `return_prompts` "prompts": {k: the
  prompt of each query}.
  """
  queries = _as_labelled(examples, text_column, label_column)
  demos = queries if pool is None else _as_labelled(pool, text_column, label_column)
  if not queries:
    raise ValueError("no examples to evaluate")
  if any(k < 0 for k in ks):
    raise ValueError(f"ks must be >= 0, got {list(ks)}")
  if sampling not in SAMPLING:
    raise ValueError(f"sampling must be one of {', '.join(SAMPLING)}, got {sampling!r}")
  if verbalisations is None:
    labels = sorted({e.label for e in [*demos, *queries]}, key=labeled._sort_key)
    verbal = {label: label for label in labels}
  else:
    verbal = {str(k): str(v) for k, v in verbalisations.items()}
    labels = list(verbal)
  if not labels or not all(verbal.values()):
    raise ValueError(f"every label needs a non-empty verbalisation, got {verbal}")
  if len(set(verbal.values())) < len(verbal):
    raise ValueError(f"two labels share a verbalisation: {verbal}")
  for e in [*queries, *demos]:
    if e.label not in verbal:
      raise CorpusError(f"{e.where}: label {e.label!r} has no verbalisation (labels: "
                        f"{', '.join(labels)})")
  limit = min(max_length or model_config.max_positions, model_config.max_positions)
  pad = getattr(tokenizer, "pad_id", None)
  pad = 0 if pad is None else pad

  pairs: list[tuple[list[int], list[int]]] = []
  plan = []  # (k, query index, first pair index)
  stats = {k: collections.Counter() for k in ks}
  prompts: dict[int, list[str]] = {k: [] for k in ks}
  k_max = max(ks, default=0)
  for q, query in enumerate(queries):
    rng = random.Random(f"{seed}:{q}")
    order = demonstration_order(demos, query, k_max, rng, sampling, labels)
    for k in ks:
      prompt, rows, kept = _fit_prompt(
          template, tokenizer, query.text,
          [(demos[i].text, verbal[demos[i].label]) for i in order[:k]],
          [verbal[label] for label in labels], limit, stats[k])
      stats[k]["shortened_prompts"] += kept < min(k, len(order))
      stats[k]["demonstrations"] += kept
      longest = max(len(p) + len(c) for p, c in rows)
      if longest > limit:
        # The query alone does not fit: keep the end of the prompt (at least one token).
        stats[k]["truncated_queries"] += 1
        rows = [(p[max(0, len(p) + len(c) - limit):], c) for p, c in rows]
        if any(not p for p, _ in rows):
          raise ValueError(f"{query.where}: a candidate alone fills max_length={limit}")
      prompts[k].append(prompt)
      plan.append((k, q, len(pairs)))
      pairs += rows

  sums = score_continuations(params, model_config, pairs, batch_size=batch_size,
                             bucket=bucket, pad_id=pad)
  counts = np.asarray([len(c) for _, c in pairs], np.float32)
  pool_counts = collections.Counter(e.label for e in demos)
  majority = max(labels, key=lambda label: (pool_counts[label], -labels.index(label)))
  by_k: dict[int, dict[str, Any]] = {}
  for k in ks:
    correct = correct_norm = 0
    predicted = collections.Counter()
    for kk, q, first in plan:
      if kk != k:
        continue
      scores = sums[first:first + len(labels)]
      norm = scores / counts[first:first + len(labels)]
      guess = labels[int(np.argmax(scores))]
      predicted[guess] += 1
      correct += guess == queries[q].label
      correct_norm += labels[int(np.argmax(norm))] == queries[q].label
    n = len(queries)
    by_k[k] = {"accuracy": correct / n, "accuracy_length_normalised": correct_norm / n,
               "correct": correct, "n": n,
               "predicted": {label: predicted[label] for label in labels},
               "demonstrations": stats[k]["demonstrations"] / n,
               "dropped_demonstrations": stats[k]["dropped_demonstrations"],
               "shortened_prompts": stats[k]["shortened_prompts"],
               "truncated_queries": stats[k]["truncated_queries"]}
  result = {"by_k": by_k, "labels": labels, "verbalisations": verbal, "n": len(queries),
            "majority_label": majority,
            "majority_baseline": sum(e.label == majority for e in queries) / len(queries),
            "chance_baseline": 1.0 / len(labels), "sampling": sampling, "seed": seed}
  if return_prompts:
    result["prompts"] = prompts
  return result


# --- multiple choice ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Choice:
  """A multiple-choice question: the query, its choices, the index of the right one."""

  query: str
  choices: tuple[str, ...]
  gold: int
  where: str = ""


def read_multiple_choice(path: str | Path) -> list[Choice]:
  """JSONL, one question per line: {"query": str, "choices": [str, ...], "gold": int} (the
  lm-evaluation-harness layout; "label" is accepted for "gold"); errors name the line."""
  out = []
  path = Path(path)
  for line, record in labeled.jsonl_records(path):
    where = f"{path}:{line}"
    record = record if isinstance(record, dict) else {}
    gold = record.get("gold", record.get("label"))
    choices = record.get("choices")
    if (not isinstance(record.get("query"), str) or not isinstance(choices, list)
        or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices)):
      raise CorpusError(f"{where}: expected \"query\" (text), \"choices\" (2+ non-empty "
                        "texts) and \"gold\" (the right choice's index)")
    if not isinstance(gold, int) or not 0 <= gold < len(choices):
      raise CorpusError(f"{where}: gold {gold!r} is not an index into its "
                        f"{len(choices)} choices")
    out.append(Choice(record["query"], tuple(choices), gold, where))
  if not out:
    raise CorpusError(f"{path}: no questions")
  return out


def is_multiple_choice(path: str | Path) -> bool:
  """Whether `path` is multiple-choice JSONL (its first record has "choices")."""
  path = Path(path)
  if path.suffix != ".jsonl":
    return False
  with path.open(encoding="utf-8") as f:
    for line in f:
      if line.strip():
        try:
          return "choices" in json.loads(line)
        except json.JSONDecodeError:
          return False
  return False


def evaluate_multiple_choice(params: Any, model_config: ModelConfig, tokenizer: Any,
                             questions: Sequence[Choice], *,
                             pool: Sequence[Choice] | None = None,
                             ks: Sequence[int] = (0, 1, 4, 8),
                             template: Template = Template(), seed: int = 0,
                             max_length: int | None = None, batch_size: int = 16,
                             bucket: int = 32) -> dict[str, Any]:
  """Few-shot accuracy on multiple-choice questions for each k (GPT-3's evaluation of
  multiple-choice tasks such as PIQA or HellaSwag): k demonstrations ("{query}\\nAnswer:" +
  " {right choice}" + "\\n\\n"), drawn per question from `pool` (default: the questions, the
  question itself excluded) as `evaluate_fewshot` draws them, then the question; the predicted
  choice is the most likely continuation, by summed and by length-normalised log-probability.
  Demonstrations that do not fit are dropped (counted). Returns {"by_k": {k: {"accuracy",
  "accuracy_length_normalised", "correct", "n", "demonstrations", "dropped_demonstrations"}},
  "chance_baseline" (the mean of 1 / choices), "n", "seed"}."""
  if not questions:
    raise ValueError("no questions to evaluate")
  if any(k < 0 for k in ks):
    raise ValueError(f"ks must be >= 0, got {list(ks)}")
  demos = list(questions if pool is None else pool)
  limit = min(max_length or model_config.max_positions, model_config.max_positions)
  pad = getattr(tokenizer, "pad_id", None)
  pad = 0 if pad is None else pad
  as_labelled = [Labelled(d.query, d.choices[d.gold], d.where) for d in demos]
  pairs: list[tuple[list[int], list[int]]] = []
  plan = []  # (k, question index, first pair index)
  stats = {k: collections.Counter() for k in ks}
  for q, question in enumerate(questions):
    rng = random.Random(f"{seed}:{q}")
    order = demonstration_order(as_labelled, Labelled(question.query, ""), max(ks, default=0),
                                rng)
    for k in ks:
      _, rows, kept = _fit_prompt(
          template, tokenizer, question.query,
          [(as_labelled[i].text, as_labelled[i].label) for i in order[:k]], question.choices,
          limit, stats[k])
      if max(len(p) + len(c) for p, c in rows) > limit:
        raise ValueError(f"{question.where}: the question and a choice exceed max_length="
                         f"{limit}")
      stats[k]["demonstrations"] += kept
      plan.append((k, q, len(pairs)))
      pairs += rows
  sums = score_continuations(params, model_config, pairs, batch_size=batch_size,
                             bucket=bucket, pad_id=pad)
  counts = np.asarray([len(c) for _, c in pairs], np.float32)
  by_k: dict[int, dict[str, Any]] = {}
  for k in ks:
    correct = correct_norm = 0
    for kk, q, first in plan:
      if kk != k:
        continue
      n_choices = len(questions[q].choices)
      scores = sums[first:first + n_choices]
      correct += int(np.argmax(scores)) == questions[q].gold
      correct_norm += int(np.argmax(scores / counts[first:first + n_choices])) == \
          questions[q].gold
    n = len(questions)
    by_k[k] = {"accuracy": correct / n, "accuracy_length_normalised": correct_norm / n,
               "correct": correct, "n": n, "demonstrations": stats[k]["demonstrations"] / n,
               "dropped_demonstrations": stats[k]["dropped_demonstrations"]}
  return {"by_k": by_k, "n": len(questions), "seed": seed,
          "chance_baseline": float(np.mean([1 / len(q.choices) for q in questions]))}
