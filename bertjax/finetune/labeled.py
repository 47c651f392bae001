"""Labelled examples for fine-tuning: GLUE-style TSV, CSV, JSONL and CoNLL readers, the label
vocabulary, and encoding into fixed-length BERT inputs.

Sentence and sentence-pair tasks read `text_a` (and optionally `text_b`) and `label` from named
columns (or 0-based column numbers for header-less files such as CoLA's); token classification
reads JSONL or CoNLL. Every malformed line is a `CorpusError` naming the file and the line.
Encoding is `[CLS] A [SEP] B [SEP]`, the longer side truncated first, padded to `seq_length`;
word tags go to each word's first piece (the rest: IGNORE, -100).

The guide: docs/finetuning.md (its first section, 'Inputs').
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from bertjax.data.errors import CorpusError
from bertjax.data.tokenizers import special_ids

TaskKind = Literal["classification", "regression", "token_classification"]
TASKS = ("classification", "regression", "token_classification")
IGNORE = -100  # label of positions that carry no loss (padding, specials, later word pieces)


@dataclasses.dataclass
class Example:
  """One labelled example; `where` is "file:line" for error messages."""

  where: str
  text_a: str = ""
  text_b: str | None = None
  label: str | float | None = None
  tokens: list[str] | None = None
  tags: list[str] | None = None


@dataclasses.dataclass(frozen=True)
class Columns:
  """Which columns (names, or 0-based numbers as strings for header-less files) hold what."""

  text_a: str = "sentence"
  text_b: str | None = None
  label: str = "label"
  tokens: str = "tokens"
  tags: str = "tags"


def _format_of(path: Path, fmt: str | None) -> str:
  if fmt:
    return fmt
  suffix = path.suffix.lower()
  formats = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl",
             ".conll": "conll", ".iob": "conll", ".bio": "conll"}
  if suffix not in formats:
    raise CorpusError(f"{path}: cannot tell the format from the suffix {suffix!r}; "
                      "use .tsv, .csv, .jsonl or .conll (or pass the format)")
  return formats[suffix]


def _column_index(path: Path, header: list[str] | None, column: str) -> int:
  if header is not None and column in header:
    return header.index(column)
  if column.isdigit():
    return int(column)
  if header is None:
    raise CorpusError(f"{path}: column {column!r}: a file without a header row takes column "
                      "numbers (0-based)")
  raise CorpusError(f"{path}:1: no column {column!r} in the header; columns: "
                    f"{', '.join(header)}")


def _rows(path: Path, fmt: str, header: bool) -> tuple[list[str] | None, list[tuple[int, list]]]:
  """(header or None, [(line number, fields)]) of a TSV/CSV file."""
  csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
  try:
    with path.open(encoding="utf-8", newline="") as f:
      if fmt == "tsv":
        # GLUE's TSVs are unquoted (quote characters are part of the text).
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
      else:
        reader = csv.reader(f)
      rows = []
      for fields in reader:
        rows.append((reader.line_num, fields))
  except UnicodeDecodeError as e:
    raise CorpusError(f"{path}: not UTF-8 text at byte {e.start}") from None
  except csv.Error as e:
    raise CorpusError(f"{path}:{reader.line_num}: {e}") from None
  rows = [(n, r) for n, r in rows if r and any(x.strip() for x in r)]
  if not header:
    return None, rows
  if not rows:
    raise CorpusError(f"{path}: empty file (expected a header row)")
  return [h.strip() for h in rows[0][1]], rows[1:]


def read_examples(path: str | Path, task: TaskKind, columns: Columns = Columns(), *,
                  fmt: str | None = None, header: bool = True,
                  require_label: bool = True) -> list[Example]:
  """Reads labelled examples from a TSV/CSV/JSONL (sentence, pair) or JSONL/CoNLL (token
  classification) file. `header=False`: TSV/CSV without a header row; columns by number."""
  path = Path(path)
  if not path.is_file():
    raise CorpusError(f"{path}: no such file")
  fmt = _format_of(path, fmt)
  if task not in TASKS:
    raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
  if task == "token_classification":
    if fmt == "conll":
      return _read_conll(path)
    if fmt != "jsonl":
      raise CorpusError(f"{path}: token classification reads JSONL or CoNLL, not {fmt}")
  if fmt == "jsonl":
    return _read_jsonl(path, task, columns, require_label)
  if fmt not in ("tsv", "csv"):
    raise CorpusError(f"{path}: {fmt} files hold token-classification data, not {task}")
  head, rows = _rows(path, fmt, header)
  wanted = {"text_a": columns.text_a, "label": columns.label}
  if columns.text_b:
    wanted["text_b"] = columns.text_b
  if not require_label and (head is None or columns.label not in head):
    wanted.pop("label")
  index = {k: _column_index(path, head, c) for k, c in wanted.items()}
  need = max(index.values()) + 1
  examples = []
  for line, fields in rows:
    if len(fields) < need:
      missing = [wanted[k] for k, i in index.items() if i >= len(fields)]
      raise CorpusError(f"{path}:{line}: {len(fields)} field(s), no value for column(s) "
                        f"{', '.join(missing)}"
                        + (" (a tab inside the text? GLUE TSVs are unquoted)"
                           if fmt == "tsv" else ""))
    label = fields[index["label"]].strip() if "label" in index else None
    examples.append(_make(path, line, task, fields[index["text_a"]],
                          fields[index["text_b"]] if "text_b" in index else None, label,
                          require_label))
  return examples


def _make(path: Path, line: int, task: str, text_a: Any, text_b: Any, label: Any,
          require_label: bool) -> Example:
  where = f"{path}:{line}"
  if require_label and (label is None or label == ""):
    raise CorpusError(f"{where}: empty label")
  if task == "regression" and label is not None and label != "":
    try:
      label = float(label)
    except (TypeError, ValueError):
      raise CorpusError(f"{where}: regression label {label!r} is not a number") from None
  elif label is not None:
    label = str(label)
  if not isinstance(text_a, str) or (text_b is not None and not isinstance(text_b, str)):
    raise CorpusError(f"{where}: text fields must be strings")
  return Example(where, text_a, text_b, label)


def jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
  """(line number, parsed value) of each non-blank line of a JSONL file; a line that is not
  JSON raises CorpusError naming the file, line and column."""
  with path.open(encoding="utf-8") as f:
    for line, text in enumerate(f, 1):
      if not text.strip():
        continue
      try:
        yield line, json.loads(text)
      except json.JSONDecodeError as e:
        raise CorpusError(f"{path}:{line}: not valid JSON ({e.msg} at column {e.colno})") \
            from None


def _read_jsonl(path: Path, task: str, columns: Columns, require_label: bool) -> list[Example]:
  examples = []
  for line, record in jsonl_records(path):
    if not isinstance(record, dict):
      raise CorpusError(f"{path}:{line}: expected a JSON object per line")
    if task == "token_classification":
      examples.append(_token_record(path, line, record, columns, require_label))
      continue
    wanted = [columns.text_a] + ([columns.text_b] if columns.text_b else [])
    if require_label:
      wanted.append(columns.label)
    missing = [c for c in wanted if c not in record]
    if missing:
      raise CorpusError(f"{path}:{line}: no field {', '.join(map(repr, missing))}; "
                        f"fields: {', '.join(record)}")
    examples.append(_make(path, line, task, record[columns.text_a],
                          record[columns.text_b] if columns.text_b else None,
                          record.get(columns.label), require_label))
  return examples


def _token_record(path: Path, line: int, record: dict, columns: Columns,
                  require_label: bool) -> Example:
  where = f"{path}:{line}"
  tokens = record.get(columns.tokens)
  tags = record.get(columns.tags)
  if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
    raise CorpusError(f"{where}: field {columns.tokens!r} must be a list of strings")
  if tags is None and not require_label:
    return Example(where, tokens=tokens)
  if not isinstance(tags, list) or len(tags) != len(tokens):
    raise CorpusError(f"{where}: field {columns.tags!r} must be a list with one tag per token "
                      f"({len(tokens)} tokens)")
  return Example(where, tokens=tokens, tags=[str(t) for t in tags])


def _read_conll(path: Path) -> list[Example]:
  """CoNLL: `word [other columns ...] tag` per line; sentences separated by blank lines;
  -DOCSTART- lines skipped."""
  examples: list[Example] = []
  tokens: list[str] = []
  tags: list[str] = []
  start = 1

  def flush():
    if tokens:
      examples.append(Example(f"{path}:{start}", tokens=list(tokens), tags=list(tags)))
    tokens.clear()
    tags.clear()

  with path.open(encoding="utf-8") as f:
    for line, text in enumerate(f, 1):
      parts = text.split()
      if not parts or parts[0] == "-DOCSTART-":
        flush()
        start = line + 1
        continue
      if len(parts) < 2:
        raise CorpusError(f"{path}:{line}: expected 'word ... tag', got {text.strip()!r}")
      if not tokens:
        start = line
      tokens.append(parts[0])
      tags.append(parts[-1])
  flush()
  return examples


# --- labels ------------------------------------------------------------------------------

def _sort_key(label: str):
  try:
    return (0, float(label), label)
  except ValueError:
    return (1, 0.0, label)


def label_vocabulary(examples: Sequence[Example], task: TaskKind) -> list[str]:
  """Label names in id order, from the training examples (numeric labels sorted by value, so
  GLUE's "0"/"1" get ids 0/1; others alphabetically, BIO tags with "O" first). Regression: []."""
  if task == "regression":
    return []
  if task == "token_classification":
    names = {t for e in examples for t in (e.tags or [])}
    rest = sorted(names - {"O"}, key=lambda t: (t[2:], t[:2]) if t[1:2] == "-" else (t, ""))
    return (["O"] if "O" in names else []) + rest
  return sorted({str(e.label) for e in examples if e.label is not None}, key=_sort_key)


def label_ids(examples: Sequence[Example], labels: Sequence[str], task: TaskKind) -> np.ndarray:
  """Sentence labels as ids (float32 targets for regression); an unknown label names the
  example's file and line."""
  if task == "regression":
    return np.asarray([e.label for e in examples], np.float32)
  index = {name: i for i, name in enumerate(labels)}
  out = np.empty(len(examples), np.int32)
  for i, e in enumerate(examples):
    if e.label not in index:
      raise CorpusError(f"{e.where}: label {e.label!r} does not occur in the training data "
                        f"(labels: {', '.join(labels)})")
    out[i] = index[e.label]
  return out


# --- encoding ----------------------------------------------------------------------------

def _specials(tokenizer) -> tuple[int, int, int]:
  ids = special_ids(tokenizer)
  if ids.get("cls") is None or ids.get("sep") is None:
    raise CorpusError(f"{tokenizer!r} has no [CLS]/[SEP] tokens; fine-tuning BERT needs a "
                      "BERT-style tokenizer")
  return ids["cls"], ids["sep"], ids.get("pad") or 0


def truncate_pair(a: list[int], b: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
  """Drops tokens from the end of the longer side until both fit (google-research/bert)."""
  a, b = list(a), list(b)
  while len(a) + len(b) > max_tokens:
    (a if len(a) > len(b) else b).pop()
  return a, b


def encode_sentences(examples: Sequence[Example], tokenizer, seq_length: int,
                     labels: Sequence[str], task: TaskKind,
                     with_labels: bool = True) -> dict[str, np.ndarray]:
  """input_ids, token_type_ids, attention_mask [N, seq_length] and labels [N] of sentence or
  sentence-pair examples."""
  cls, sep, pad = _specials(tokenizer)
  n = len(examples)
  ids = np.full((n, seq_length), pad, np.int32)
  types = np.zeros((n, seq_length), np.int32)
  mask = np.zeros((n, seq_length), np.int32)
  a_ids = tokenizer.encode_batch([e.text_a for e in examples])
  pair = any(e.text_b is not None for e in examples)
  b_ids = tokenizer.encode_batch([e.text_b or "" for e in examples]) if pair else [[]] * n
  for i, e in enumerate(examples):
    if e.text_b is not None:
      a, b = truncate_pair(a_ids[i], b_ids[i], seq_length - 3)
      row = [cls] + a + [sep] + b + [sep]
      segment = [0] * (len(a) + 2) + [1] * (len(b) + 1)
    else:
      a = a_ids[i][:seq_length - 2]
      row = [cls] + a + [sep]
      segment = [0] * len(row)
    ids[i, :len(row)] = row
    types[i, :len(row)] = segment
    mask[i, :len(row)] = 1
  out = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
  if with_labels:
    out["labels"] = label_ids(examples, labels, task)
  return out


def encode_tagged(examples: Sequence[Example], tokenizer, seq_length: int,
                  labels: Sequence[str], with_labels: bool = True) -> dict[str, np.ndarray]:
  """Token-classification inputs: labels [N, seq_length] hold the word's tag id on its first
  piece and IGNORE elsewhere; `word_index` [N, seq_length] the word each first piece starts
  (-1 elsewhere), to map predictions back to words. Words beyond seq_length are cut off."""
  cls, sep, pad = _specials(tokenizer)
  index = {name: i for i, name in enumerate(labels)}
  n = len(examples)
  ids = np.full((n, seq_length), pad, np.int32)
  mask = np.zeros((n, seq_length), np.int32)
  tags = np.full((n, seq_length), IGNORE, np.int32)
  words = np.full((n, seq_length), -1, np.int32)
  for i, e in enumerate(examples):
    pieces = tokenizer.encode_batch(e.tokens) if e.tokens else []
    row, row_tags, row_words = [cls], [IGNORE], [-1]
    for w, word_pieces in enumerate(pieces):
      word_pieces = word_pieces or [_unk(tokenizer)]
      if len(row) + len(word_pieces) > seq_length - 1:
        break
      tag = IGNORE
      if with_labels and e.tags is not None:
        if e.tags[w] not in index:
          raise CorpusError(f"{e.where}: tag {e.tags[w]!r} (word {w + 1}) does not occur in "
                            f"the training data (tags: {', '.join(labels)})")
        tag = index[e.tags[w]]
      row += word_pieces
      row_tags += [tag] + [IGNORE] * (len(word_pieces) - 1)
      row_words += [w] + [-1] * (len(word_pieces) - 1)
    row.append(sep)
    row_tags.append(IGNORE)
    row_words.append(-1)
    ids[i, :len(row)] = row
    mask[i, :len(row)] = 1
    tags[i, :len(row)] = row_tags
    words[i, :len(row)] = row_words
  out = {"input_ids": ids, "token_type_ids": np.zeros_like(ids), "attention_mask": mask,
         "word_index": words}
  if with_labels:
    out["labels"] = tags
  return out


def _unk(tokenizer) -> int:
  unk = special_ids(tokenizer).get("unk")
  return 0 if unk is None else unk


def encode(examples: Sequence[Example], tokenizer, seq_length: int, labels: Sequence[str],
           task: TaskKind, with_labels: bool = True) -> dict[str, np.ndarray]:
  """Fixed-length model inputs (and labels) for any task kind."""
  if not examples:
    raise CorpusError("no examples to encode")
  if task == "token_classification":
    return encode_tagged(examples, tokenizer, seq_length, labels, with_labels)
  return encode_sentences(examples, tokenizer, seq_length, labels, task, with_labels)
