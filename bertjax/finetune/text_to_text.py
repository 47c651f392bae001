"""Text-to-text fine-tuning of an encoder-decoder (T5, BART): a task as input text -> target text
(Raffel et al. 2020, section 2.4), trained on the decoder's cross-entropy over the target
(objective `text_to_text`) and scored on the text the model generates (greedy) for each dev
input.

The training file's format says what the task is (`FORMATS`: SQuAD JSON, prompt/completion
JSONL, GLUE-style labels); examples are packed in order into rows while both sides fit.

The guide: docs/finetuning.md, 'Text to text: T5 and BART'.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np

from bertjax.data import schema
from bertjax.data.errors import CorpusError
from bertjax.data.seq2seq import Specials
from bertjax.finetune import labeled, scores, squad
from bertjax.inference import generate

# Format -> the dev metric that selects the best parameters.
FORMATS = {"squad": "f1", "prompt_completion": "f1", "labels": "accuracy"}
NO_ANSWER = "unanswerable"  # the target of an unanswerable SQuAD v2.0 question


@dataclasses.dataclass(frozen=True)
class Example:
  """One input -> target pair; `answers` are what a generation is scored against."""

  id: str
  source: str
  target: str
  answers: tuple[str, ...]


def format_of(path: Path) -> str:
  """`squad` for a SQuAD JSON file, `prompt_completion` for JSONL whose first record has a
  prompt, else `labels`."""
  if path.suffix.lower() == ".json":
    try:
      whole = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
      whole = None
    if isinstance(whole, dict) and "data" in whole:
      return "squad"
  if path.suffix.lower() in (".jsonl", ".json"):
    first = next(labeled.jsonl_records(path), (0, None))[1]
    if isinstance(first, dict) and "prompt" in first:
      return "prompt_completion"
  return "labels"


def read_examples(path: str | Path, kind: str, ft: ml_collections.ConfigDict
                  ) -> list[Example]:
  """The examples of `path` in format `kind`; a malformed record is a CorpusError naming the
  file and line (or the question's id)."""
  path = Path(path)
  if not path.is_file():
    raise CorpusError(f"{path}: no such file")
  if kind == "squad":
    return [Example(e.id, f"question: {e.question} context: {e.context}",
                    e.answers[0][0] if e.answers else NO_ANSWER,
                    tuple(text for text, _ in e.answers))
            for e in squad.read_squad(path)]
  if kind == "prompt_completion":
    out = []
    for line, record in labeled.jsonl_records(path):
      where = f"{path}:{line}"
      if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) \
          or not isinstance(record.get("completion"), str):
        raise CorpusError(f"{where}: expected {{\"prompt\": text, \"completion\": text}}"
                          + ("; chat records are for GPT (--task completion)"
                             if isinstance(record, dict) and "messages" in record else ""))
      out.append(Example(where, record["prompt"], record["completion"].strip(),
                         (record["completion"].strip(),)))
    return out
  columns = labeled.Columns(ft.text_a, ft.text_b or None, ft.label)
  pair = bool(ft.text_b)
  return [Example(e.where, f"sentence1: {e.text_a} sentence2: {e.text_b}" if pair
                  else f"sentence: {e.text_a}", str(e.label), (str(e.label),))
          for e in labeled.read_examples(path, "classification", columns,
                                         header=bool(ft.header))]


@dataclasses.dataclass
class Encoded:
  sources: list[list[int]]
  targets: list[list[int]]
  cut_sources: int
  cut_targets: int


def encode(examples: Sequence[Example], tokenizer: Any, frame: Specials, seq_length: int,
           target_length: int) -> Encoded:
  sources, targets, cut_sources, cut_targets = [], [], 0, 0
  for e in examples:
    source, cut = frame.wrap(tokenizer.encode(e.source), seq_length)
    target, cut_target = frame.wrap(tokenizer.encode(e.target), target_length)
    sources.append(source)
    targets.append(target)
    cut_sources += cut
    cut_targets += cut_target
  return Encoded(sources, targets, cut_sources, cut_targets)


def pack(encoded: Encoded, seq_length: int, target_length: int, frame: Specials
         ) -> dict[str, np.ndarray]:
  """Rows of the examples in order, a row taking the next example while its source and target
  both fit (numpy int32 [R, seq_length] for the encoder's fields, [R, target_length] for the
  decoder's)."""
  placed: list[list[int]] = []
  used = (seq_length, target_length)
  for i, (s, t) in enumerate(zip(encoded.sources, encoded.targets)):
    if used[0] + len(s) > seq_length or used[1] + len(t) > target_length:
      placed.append([])
      used = (0, 0)
    placed[-1].append(i)
    used = (used[0] + len(s), used[1] + len(t))
  rows = {f.name: np.zeros(schema.shape(f, len(placed), seq_length, 0, target_length), f.dtype)
          for f in schema.fields("text_to_text")}
  for key in ("input_ids", "decoder_input_ids", "target_ids"):
    rows[key][:] = frame.pad
  for r, members in enumerate(placed):
    at = [0, 0]
    for segment, i in enumerate(members, 1):
      s, t = encoded.sources[i], encoded.targets[i]
      rows["input_ids"][r, at[0]:at[0] + len(s)] = s
      rows["document_ids"][r, at[0]:at[0] + len(s)] = segment
      span = slice(at[1], at[1] + len(t))
      rows["target_ids"][r, span] = t
      rows["decoder_input_ids"][r, span] = [frame.start] + t[:-1]
      rows["decoder_document_ids"][r, span] = segment
      rows["loss_mask"][r, span] = 1
      at = [at[0] + len(s), at[1] + len(t)]
  return rows


def generate_texts(params: Any, model_config: Any, tokenizer: Any, frame: Specials,
                   sources: Sequence[Sequence[int]], batch_size: int, seq_length: int,
                   max_new_tokens: int) -> list[str]:
  """Greedy generations of `sources` (host parameters; batches of `batch_size` padded to
  `seq_length`, so one program serves them all), decoded without special tokens."""
  texts = []
  for start in range(0, len(sources), batch_size):
    chunk = list(sources[start:start + batch_size])
    real = len(chunk)
    chunk += [chunk[-1]] * (batch_size - real)
    new = generate.generate_seq2seq(params, model_config, chunk, decoder_start=frame.start,
                                    source_length=seq_length, max_new_tokens=max_new_tokens,
                                    stop_tokens=(frame.eos,))
    texts += [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in new[:real]]
  return texts


def score(kind: str, examples: Sequence[Example], generated: Sequence[str]) -> dict[str, float]:
  """The format's scores of `generated` (one text per example)."""
  if kind == "labels":
    labels = {e.target for e in examples}
    right = [g == e.target for e, g in zip(examples, generated)]
    return {"accuracy": float(np.mean(right)),
            "not_a_label": float(np.mean([g not in labels for g in generated]))}
  as_qa = [squad.QAExample(e.id, "", "", [(a, 0) for a in e.answers], not e.answers)
           for e in examples]
  answers = {e.id: ("" if kind == "squad" and g == NO_ANSWER else g)
             for e, g in zip(examples, generated)}
  version = "2.0" if kind == "squad" and any(not e.answers for e in examples) else "1.1"
  result = scores.squad_scores(answers, as_qa, version)
  result.pop("total", None)
  return result
