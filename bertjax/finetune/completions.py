"""GPT fine-tuning data: prompt/completion and chat records (JSONL), encoded with the loss on the
completions only and packed whole into fixed rows for `objectives.CausalLM` (`load_completions`).

A chat is rendered as plain text, one "System:" or "User:" line per message and "Assistant:
{content}<|endoftext|>" per assistant message; each assistant message is a completion, the rest
prompt. Packing (`pack_examples`) is first-fit in input order, each example whole in its own
segment.

The guide: docs/finetuning.md, 'GPT on prompts and completions'.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bertjax.data.errors import CorpusError, SkipCounts
from bertjax.finetune.labeled import jsonl_records

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}
EOT_TEXT = "<|endoftext|>"  # how an <|endoftext|> id is spelled in held-out prompt text
BATCH_KEYS = ("input_ids", "target_ids", "loss_mask", "document_ids", "positions")
# Skips logged one by one before further ones are only counted.
_LOGGED_SKIPS = 20


@dataclasses.dataclass(frozen=True)
class CompletionRecord:
  """One record as (prompt text, completion text) turns, each completion closed by
  <|endoftext|>; a prompt/completion record has one turn. `where` is "file:line"."""

  where: str
  turns: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class EncodedExample:
  """Tokens of one example and, per token, whether predicting it is trained (completion tokens
  and their <|endoftext|>); `completion_start`: index of the last completion's first token."""

  where: str
  tokens: tuple[int, ...]
  in_loss: tuple[bool, ...]
  completion_start: int


@dataclasses.dataclass(frozen=True)
class HeldOut:
  """A held-out example for generation: generate from `prompt_ids` (exactly the tokens
  training puts before the completion) and compare with `completion`, the reference text as
  trained (leading space included). `prompt` is its text, with <|endoftext|> spelled out
  between earlier chat turns."""

  where: str
  prompt: str
  completion: str
  prompt_ids: tuple[int, ...]


@dataclasses.dataclass
class PackedCompletions:
  """`rows`: numpy int32 [R, seq_length] per CausalLM batch key; `held_out`: examples kept out
  of the rows, for generation; counts of what was packed, cut and skipped."""

  rows: dict[str, np.ndarray]
  held_out: list[HeldOut]
  examples: int  # examples packed into rows
  truncated: int  # of those, how many lost prompt tokens on the left
  skips: SkipCounts
  loss_tokens: int  # targets with loss_mask 1, all rows
  tokens: int  # non-padding slots, all rows


# --- reading -----------------------------------------------------------------------------


def read_completion_records(path: str | Path) -> list[CompletionRecord]:
  """Records of a JSONL file (prompt/completion or chat: docs/finetuning.md, 'GPT on prompts
  and completions'); a malformed line raises CorpusError naming the file and line."""
  path = Path(path)
  if not path.is_file():
    raise CorpusError(f"{path}: no such file")
  records = []
  try:
    for line, obj in jsonl_records(path):
      records.append(parse_record(obj, f"{path}:{line}"))
  except UnicodeDecodeError as e:
    raise CorpusError(f"{path}: not UTF-8 text at byte {e.start}") from None
  if not records:
    raise CorpusError(f"{path}: no records (expected one JSON object per line)")
  return records


def parse_record(obj: Any, where: str) -> CompletionRecord:
  """One JSON record (already parsed) -> CompletionRecord; `where` names it in errors."""
  if not isinstance(obj, dict):
    raise CorpusError(f"{where}: expected a JSON object, got {type(obj).__name__}")
  if "messages" in obj:
    return _chat_record(obj["messages"], where)
  if "prompt" not in obj or "completion" not in obj:
    missing = [k for k in ("prompt", "completion") if k not in obj]
    raise CorpusError(f"{where}: no field {', '.join(map(repr, missing))}; expected "
                      f"{{\"prompt\", \"completion\"}} or {{\"messages\"}}, fields: "
                      f"{', '.join(map(repr, obj)) or 'none'}")
  prompt, completion = obj["prompt"], obj["completion"]
  for name, value in (("prompt", prompt), ("completion", completion)):
    if not isinstance(value, str):
      raise CorpusError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
  if not prompt:
    raise CorpusError(f"{where}: empty prompt: the completion's first token would have "
                      "nothing to be predicted from")
  return CompletionRecord(where, ((prompt, completion),))


def _chat_record(messages: Any, where: str) -> CompletionRecord:
  if not isinstance(messages, list) or not messages:
    raise CorpusError(f"{where}: field 'messages' must be a non-empty list of "
                      "{\"role\", \"content\"} objects")
  turns, prompt = [], ""
  for i, message in enumerate(messages, 1):
    if not isinstance(message, dict):
      raise CorpusError(f"{where}: message {i}: expected an object with 'role' and 'content'")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
      raise CorpusError(f"{where}: message {i}: role {role!r} is not one of "
                        f"{', '.join(ROLES)}")
    if not isinstance(content, str):
      raise CorpusError(f"{where}: message {i}: 'content' must be a string, got "
                        f"{type(content).__name__}")
    if role == "assistant":
      turns.append((prompt + "Assistant:", " " + content))
      prompt = ""
    else:
      prompt += f"{ROLE_NAMES[role]}: {content}\n"
  if not turns:
    raise CorpusError(f"{where}: conversation has no assistant message (nothing to learn)")
  return CompletionRecord(where, tuple(turns))


# --- encoding ----------------------------------------------------------------------------


def _eot(tokenizer: Any) -> int:
  eot = getattr(tokenizer, "eot_id", None)
  if eot is None:
    raise ValueError(f"{tokenizer!r} has no <|endoftext|> token; GPT fine-tuning needs a GPT "
                     "tokenizer (load_tokenizer(path, require='gpt'))")
  return eot


def split_encode(tokenizer: Any, prompt: str, completion: str) -> tuple[list[int], list[int]]:
  """(prompt tokens, completion tokens) of prompt + completion encoded as one text, split
  where `encode(prompt)` stops being a prefix (a straddling token goes to the completion)."""
  whole = list(tokenizer.encode(prompt + completion))
  alone = tokenizer.encode(prompt)
  shared = 0
  for a, b in zip(alone, whole):
    if a != b:
      break
    shared += 1
  return whole[:shared], whole[shared:]


def encode_record(record: CompletionRecord, tokenizer: Any) -> EncodedExample:
  """Tokens of a record (prompt + completion + <|endoftext|> per turn) and their loss flags."""
  eot = _eot(tokenizer)
  tokens: list[int] = []
  in_loss: list[bool] = []
  start = 0
  for prompt, completion in record.turns:
    head, tail = split_encode(tokenizer, prompt, completion)
    start = len(tokens) + len(head)
    tokens += head + tail + [eot]
    in_loss += [False] * len(head) + [True] * (len(tail) + 1)
  return EncodedExample(record.where, tuple(tokens), tuple(in_loss), start)


def held_out_example(record: CompletionRecord, tokenizer: Any) -> HeldOut:
  """The record's last completion as a generation task: prompt ids (all that precedes it in
  training, earlier turns included) and the reference completion text."""
  eot = _eot(tokenizer)
  ids: list[int] = []
  text = ""
  for i, (prompt, completion) in enumerate(record.turns):
    head, tail = split_encode(tokenizer, prompt, completion)
    if i == len(record.turns) - 1:
      return HeldOut(record.where, text + prompt, completion, tuple(ids + head))
    ids += head + tail + [eot]
    text += prompt + completion + EOT_TEXT
  raise AssertionError("a record has at least one turn")


# --- packing -----------------------------------------------------------------------------


def fit_example(example: EncodedExample, seq_length: int) -> EncodedExample | None:
  """The example cut from the left to `seq_length` tokens (None when its last completion and
  <|endoftext|> would not keep at least one token before them)."""
  cut = len(example.tokens) - seq_length
  if cut <= 0:
    return example
  if example.completion_start - cut < 1:
    return None
  return EncodedExample(example.where, example.tokens[cut:], example.in_loss[cut:],
                        example.completion_start - cut)


class _FirstFit:
  """First-fit bin choice in O(log rows): a max-tree over each row's free slots."""

  def __init__(self, max_rows: int, capacity: int):
    self._size = 1
    while self._size < max(max_rows, 1):
      self._size *= 2
    self._free = [capacity] * (2 * self._size)
    self.used = 0  # rows opened so far

  def place(self, need: int) -> int:
    """The lowest row with `need` free slots (it must exist: there are max_rows rows); takes
    them."""
    node = 1
    while node < self._size:
      node = 2 * node if self._free[2 * node] >= need else 2 * node + 1
    row = node - self._size
    self._free[node] -= need
    node //= 2
    while node:
      self._free[node] = max(self._free[2 * node], self._free[2 * node + 1])
      node //= 2
    self.used = max(self.used, row + 1)
    return row


def pack_examples(examples: Sequence[EncodedExample], seq_length: int, pad_id: int,
                  skips: SkipCounts | None = None
                  ) -> tuple[dict[str, np.ndarray], int, SkipCounts]:
  """Packs whole examples first-fit into rows of `seq_length` (docs/finetuning.md, 'Packing').

  Returns the rows (numpy int32 [R, seq_length] per CausalLM key), how many examples were cut
  to fit, and the skip counts."""
  if seq_length < 2:
    raise ValueError(f"seq_length must be >= 2, got {seq_length}")
  skips = skips if skips is not None else SkipCounts()
  fitted, truncated = [], 0
  for example in examples:
    fit = fit_example(example, seq_length)
    if fit is None:
      skips.add("completion longer than seq_length")
      if skips.counts["completion longer than seq_length"] <= _LOGGED_SKIPS:
        log.warning("%s: skipped: the completion (%d tokens with <|endoftext|>) does not fit "
                    "in seq_length=%d behind a prompt token", example.where,
                    len(example.tokens) - example.completion_start, seq_length)
      continue
    truncated += fit is not example
    fitted.append(fit)
  bins = _FirstFit(len(fitted), seq_length)
  placed: list[list[EncodedExample]] = [[] for _ in fitted]
  for example in fitted:
    placed[bins.place(len(example.tokens))].append(example)
  rows = {k: np.zeros((bins.used, seq_length), np.int32) for k in BATCH_KEYS}
  rows["input_ids"][:] = pad_id
  rows["target_ids"][:] = pad_id
  for r, members in enumerate(placed[:bins.used]):
    at = 0
    for segment, example in enumerate(members, 1):
      n = len(example.tokens)
      tokens = np.asarray(example.tokens, np.int32)
      rows["input_ids"][r, at:at + n] = tokens
      # The last token's target lies outside the example: padding, loss_mask 0.
      rows["target_ids"][r, at:at + n - 1] = tokens[1:]
      rows["loss_mask"][r, at:at + n - 1] = np.asarray(example.in_loss[1:], np.int32)
      rows["document_ids"][r, at:at + n] = segment
      rows["positions"][r, at:at + n] = np.arange(n, dtype=np.int32)
      at += n
  return rows, truncated, skips


def load_completions(paths: str | Path | Sequence[str | Path], tokenizer: Any,
                     seq_length: int, *, holdout: int = 0, seed: int = 0) -> PackedCompletions:
  """Reads JSONL records from `paths`, holds out `holdout` of them (a seeded random choice,
  kept in file order) for generation, and packs the rest (`pack_examples`)."""
  if isinstance(paths, (str, Path)):
    paths = [paths]
  records = [r for p in paths for r in read_completion_records(p)]
  if not 0 <= holdout < len(records):
    raise ValueError(f"holdout={holdout}: must be >= 0 and leave at least one of the "
                     f"{len(records)} records for training")
  held = set(random.Random(seed).sample(range(len(records)), holdout))
  train = [r for i, r in enumerate(records) if i not in held]
  examples = [encode_record(r, tokenizer) for r in train]
  pad = getattr(tokenizer, "pad_id", None)
  rows, truncated, skips = pack_examples(examples, seq_length, 0 if pad is None else pad)
  if not len(rows["input_ids"]):
    raise CorpusError(f"{', '.join(map(str, paths))}: no example fits in seq_length="
                      f"{seq_length} ({skips.summary()})")
  if skips.counts:
    log.warning("%s: skipped %s", ", ".join(map(str, paths)), skips.summary())
  return PackedCompletions(
      rows=rows,
      held_out=[held_out_example(records[i], tokenizer) for i in sorted(held)],
      examples=int(np.sum(rows["document_ids"].max(axis=1))),
      truncated=truncated, skips=skips,
      loss_tokens=int(rows["loss_mask"].sum()),
      tokens=int((rows["document_ids"] > 0).sum()))
