"""Decontamination at build time (`bertjax data build --decontaminate EVAL`): documents that
share a long word n-gram (13 by default, as GPT-3, Brown et al. 2020, appendix C) with an
evaluation set are dropped and counted ("contaminated document").

Words are runs of letters and digits of the NFKC-normalised, case-folded text; the index is a
sorted array of 64-bit hashes of the evaluation n-grams, saved once per build process and
mapped by its workers, and a lookup is a binary search per document n-gram.

The guide: docs/data.md, 'Decontamination'.
"""

from __future__ import annotations

import bz2
import csv
import dataclasses
import functools
import gzip
import hashlib
import io
import json
import re
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bertjax.data.errors import CorpusError

DEFAULT_NGRAM = 13
_WORD = re.compile(r"\w+")
# The polynomial hash's multiplier (odd, so multiplication is a bijection mod 2^64).
_BASE = np.uint64(0x9E3779B97F4A7C15)


def words(text: str) -> list[str]:
  """The words n-grams are made of: case, punctuation and Unicode variants folded away."""
  return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


@functools.lru_cache(maxsize=1 << 20)
def _word_hash(word: str) -> int:
  return int.from_bytes(hashlib.blake2b(word.encode("utf-8", "surrogatepass"),
                                        digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser: every output bit depends on every input bit."""
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def ngram_hashes(text: str, n: int = DEFAULT_NGRAM) -> np.ndarray:
  """The 64-bit hash of every n consecutive words of `text` (empty below n words)."""
  w = np.fromiter((_word_hash(x) for x in words(text)), dtype=np.uint64)
  count = len(w) - n + 1
  if count <= 0:
    return np.zeros(0, np.uint64)
  acc = np.zeros(count, np.uint64)
  with np.errstate(over="ignore"):
    for j in range(n):
      acc = acc * _BASE + w[j:j + count]
    return _mix(acc)


@dataclasses.dataclass
class EvalSetStats:
  """What one evaluation set (file or directory) gave the index."""

  path: str
  texts: int = 0
  short_texts: int = 0  # fewer than n words: no n-gram
  ngrams: int = 0  # with repeats

  def line(self, n: int) -> str:
    return (f"{self.path}: {self.texts:,} texts, {self.ngrams:,} {n}-grams"
            + (f" ({self.short_texts:,} texts under {n} words give none)"
               if self.short_texts else ""))


class NgramIndex:
  """The sorted distinct n-gram hashes of the evaluation sets."""

  def __init__(self, hashes: np.ndarray, n: int):
    self.hashes = hashes
    self.n = n

  @classmethod
  def from_texts(cls, texts: Iterable[str], n: int = DEFAULT_NGRAM) -> NgramIndex:
    return cls._of([ngram_hashes(t, n) for t in texts], n)

  @classmethod
  def _of(cls, parts: list[np.ndarray], n: int) -> NgramIndex:
    """The index of the hashes in `parts` (sorted, each once)."""
    return cls(np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64), n)

  @classmethod
  def from_eval_sets(cls, paths: Iterable[str | Path], n: int = DEFAULT_NGRAM
                     ) -> tuple[NgramIndex, list[EvalSetStats]]:
    """The index of every text of the evaluation sets at `paths`, with each set's counts.
    CorpusError for an unreadable set and for one with no text of n words or more."""
    parts, stats = [], []
    for path in paths:
      s = EvalSetStats(str(path))
      for text in eval_texts(path):
        h = ngram_hashes(text, n)
        s.texts += 1
        s.short_texts += not len(h)
        s.ngrams += len(h)
        parts.append(h)
      if not s.ngrams:
        raise CorpusError(f"{path}: no text of {n} or more words ({s.texts:,} texts): nothing "
                          f"to decontaminate against")
      stats.append(s)
    return cls._of(parts, n), stats

  def __len__(self) -> int:
    return len(self.hashes)

  def digest(self) -> str:
    """A fingerprint of the index (dataset.json records it)."""
    return hashlib.blake2b(self.hashes.tobytes(), digest_size=8).hexdigest()

  def contains(self, text: str) -> bool:
    """Whether `text` shares an n-gram with the evaluation sets."""
    if not len(self.hashes):
      return False
    h = ngram_hashes(text, self.n)
    if not len(h):
      return False
    pos = np.minimum(np.searchsorted(self.hashes, h), len(self.hashes) - 1)
    return bool(np.any(self.hashes[pos] == h))

  def save(self, path: str | Path) -> None:
    np.save(path, self.hashes)

  @classmethod
  def load(cls, path: str | Path, n: int) -> NgramIndex:
    return cls(np.load(path, mmap_mode="r"), n)


# --- evaluation sets ---------------------------------------------------------------------------

_SUFFIXES = (".json", ".jsonl", ".tsv", ".csv", ".txt")


def _open_text(path: Path) -> io.TextIOBase:
  opener = {".gz": gzip.open, ".bz2": bz2.open}.get(path.suffix, open)
  return opener(path, "rt", encoding="utf-8", newline="")


def _format(path: Path) -> str:
  name = path.name[:-len(path.suffix)] if path.suffix in (".gz", ".bz2") else path.name
  suffix = Path(name).suffix
  return suffix if suffix in _SUFFIXES else ".txt"


def _strings(value: Any) -> Iterator[str]:
  """Every string of a JSON value (SQuAD's contexts, questions and answers; any record's
  fields): keys are names, not text."""
  if isinstance(value, str):
    yield value
  elif isinstance(value, dict):
    for v in value.values():
      yield from _strings(v)
  elif isinstance(value, list):
    for v in value:
      yield from _strings(v)


def eval_texts(path: str | Path) -> Iterator[str]:
  """The texts of an evaluation set: a file, or every file under a directory (a GLUE task's
  folder), by suffix (plain, .gz or .bz2): .json (SQuAD and any JSON: its string values),
  .jsonl (each line's string values), .tsv/.csv (each cell: GLUE's sentences, questions,
  premises...), anything else plain text (each line). CorpusError naming the file and the
  line for a missing file, undecodable text or malformed JSON: a set must be read whole."""
  path = Path(path).expanduser()
  if path.is_dir():
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
      raise CorpusError(f"{path}: no files in the evaluation set's directory")
  elif path.is_file():
    files = [path]
  else:
    raise CorpusError(f"{path}: no such evaluation set")
  for file in files:
    yield from _file_texts(file)


def _file_texts(path: Path) -> Iterator[str]:
  fmt = _format(path)
  line = 0
  try:
    with _open_text(path) as f:
      if fmt == ".json":
        text = f.read()
        try:
          yield from _strings(json.loads(text))
        except json.JSONDecodeError as e:
          raise CorpusError(f"{path}: line {e.lineno}: not JSON ({e.msg})") from None
      elif fmt == ".jsonl":
        for line, raw in enumerate(f, 1):
          if raw.strip():
            try:
              yield from _strings(json.loads(raw))
            except json.JSONDecodeError as e:
              raise CorpusError(f"{path}:{line}: not a JSON line ({e.msg})") from None
      elif fmt in (".tsv", ".csv"):
        # GLUE's TSVs are unquoted (a sentence may hold a lone quote mark), as its readers take.
        rows = (csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if fmt == ".tsv"
                else csv.reader(f))
        for line, row in enumerate(rows, 1):  # noqa: B007 - `line` is read by the excepts
          yield from row
      else:
        for line, raw in enumerate(f, 1):  # noqa: B007 - `line` is read by the excepts
          yield raw
  except UnicodeDecodeError as e:
    raise CorpusError(f"{path}: {_after(line)}: not UTF-8 text ({e.reason})") from None
  except csv.Error as e:
    raise CorpusError(f"{path}: {_after(line)}: malformed {fmt[1:].upper()} ({e})") from None
  except (OSError, EOFError) as e:
    raise CorpusError(f"{path}: {_after(line)}: cannot be read ({e})") from None


def _after(line: int) -> str:
  """Where a read failed: text is decoded ahead of the lines handed out."""
  return f"after line {line}" if line else "in its first lines"
