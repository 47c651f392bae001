"""Whole-word masking schemes beyond BERT's single tokens, and SpanBERT's span-boundary targets:
`mask_ngrams` (ALBERT, Lan et al. 2020, §4.1), `mask_spans` (SpanBERT, Joshi et al. 2020, §3.1)
and `span_boundary_targets` (SpanBERT's SBO, §3.2).

`bert_instances.mask_tokens` dispatches here on `InstanceConfig.masking`, with BERT's budget.
Word structure is computed with numpy and the draws come from one numpy generator seeded by the
instance's `random.Random`, so a sequence costs a few Python steps per span, not per token.

The guide: docs/data.md, 'Masking schemes'.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

MASKINGS = ("token", "ngram", "span")


class SpecialTokens(Protocol):
  """What the maskers read of `bert_instances.SpecialIds`."""

  cls: int
  sep: int
  mask: int
  vocab_size: int


Masked = tuple[list[int], list[int], list[int]]  # (masked tokens, sorted positions, labels)


class ContinuationTable:
  """`is_continuation` as a boolean table over the vocabulary: one numpy gather per sequence
  instead of a Python call per token (a WordPiece `is_continuation` decodes the piece each
  time). Calling it answers like the function it was made from."""

  def __init__(self, table: np.ndarray):
    self.table = np.asarray(table, bool)
    self._answers = self.table.tolist()  # a list index is several times a numpy scalar's speed

  @classmethod
  def of(cls, is_continuation: Callable[[int], bool], vocab_size: int) -> ContinuationTable:
    return cls(np.fromiter((bool(is_continuation(i)) for i in range(vocab_size)), bool,
                           vocab_size))

  def __call__(self, token_id: int) -> bool:
    if token_id < 0:
      raise IndexError(f"token id {token_id} outside the vocabulary")
    return self._answers[token_id]


def continuations(tokens: np.ndarray, is_continuation: Callable[[int], bool]) -> np.ndarray:
  """Per token, whether it continues a word: one gather from a ContinuationTable, else a call
  per token."""
  table = getattr(is_continuation, "table", None)
  if table is not None:
    return table[tokens]
  return np.fromiter((bool(is_continuation(int(t))) for t in tokens), bool, len(tokens))


def check_settings(masking: str, ngram_max: int, span_geometric_p: float,
                   span_max_length: int) -> None:
  """A one-line ValueError naming the `data.*` key of a setting no masking could use."""
  if masking not in MASKINGS:
    raise ValueError(f"data.masking={masking!r}: choose from {', '.join(MASKINGS)}")
  if int(ngram_max) < 1:
    raise ValueError(f"data.ngram_max={ngram_max!r}: must be at least 1")
  if not 0 < float(span_geometric_p) <= 1:
    raise ValueError(f"data.span_geometric_p={span_geometric_p!r}: must be in (0, 1]")
  if int(span_max_length) < 1:
    raise ValueError(f"data.span_max_length={span_max_length!r}: must be at least 1")


@functools.cache
def ngram_pmf(ngram_max: int) -> np.ndarray:
  """ALBERT's p(n) = (1/n) / Σ_{k=1..N} 1/k for n = 1..N (index n - 1)."""
  weights = 1.0 / np.arange(1, ngram_max + 1)
  return weights / weights.sum()


@functools.cache
def span_length_pmf(p: float, max_length: int) -> np.ndarray:
  """SpanBERT's span lengths: Geometric(p) on 1, 2, ... clipped at `max_length` by
  renormalising, p(l) ∝ p (1 - p)^(l - 1) for l = 1..max_length (index l - 1)."""
  weights = p * (1.0 - p) ** np.arange(max_length)
  return weights / weights.sum()


def draw_lengths(gen: np.random.Generator, pmf: np.ndarray, count: int) -> np.ndarray:
  """`count` draws of a length from `pmf` (over 1..len(pmf)) by inverting its CDF."""
  cdf = np.cumsum(pmf)
  cdf[-1] = 1.0  # rounding must not leave a sliver above the last length
  return np.searchsorted(cdf, gen.random(count), side="right") + 1


def _words(tokens: np.ndarray, special: SpecialTokens,
           is_continuation: Callable[[int], bool]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(starts, ends, joined) of the whole words between [CLS]/[SEP]: word k is tokens
  starts[k]:ends[k], and joined[k] says word k + 1 follows it in the same segment. A piece
  right after [CLS]/[SEP] or at position 0 (a packed row that begins mid-word) starts a word."""
  n = len(tokens)
  boundary = (tokens == special.cls) | (tokens == special.sep)
  continues = continuations(tokens, is_continuation)
  after_boundary = np.concatenate([[True], boundary[:-1]])
  start = ~boundary & (~continues | after_boundary)
  starts = np.flatnonzero(start)
  cuts = np.concatenate([np.flatnonzero(start | boundary), [n]])
  ends = cuts[np.searchsorted(cuts, starts, side="right")]
  joined = np.concatenate([ends[:-1] == starts[1:], [False]])[:len(starts)]
  return starts, ends, joined


def _generator(rng: random.Random) -> np.random.Generator:
  # One 64-bit draw from the instance's stream seeds every draw of this sequence's masking.
  return np.random.default_rng(rng.getrandbits(64))


def mask_ngrams(tokens: Sequence[int], special: SpecialTokens,
                is_continuation: Callable[[int], bool], rng: random.Random, *, budget: int,
                ngram_max: int = 3, mask_token_prob: float = 0.8,
                random_token_prob: float = 0.5) -> Masked:
  """ALBERT's n-gram masking: word starts in a random order; at each, n ~ p(n) ∝ 1/n and the
  n-gram of n whole words from there (fewer at a segment's end); shorter n-grams are tried
  while it would exceed the budget, then it is skipped if still too long or if it overlaps a
  masked word; until `budget` tokens are masked. Each masked token then gets [MASK] with
  `mask_token_prob`, else a random token with `random_token_prob`, else keeps its own."""
  array = np.asarray(tokens, np.int64)
  starts, ends, joined = _words(array, special, is_continuation)
  count, gen = len(starts), _generator(rng)
  if not count or budget <= 0:
    return list(tokens), [], []
  order = gen.permutation(count).tolist()
  lengths = draw_lengths(gen, ngram_pmf(ngram_max), count).tolist()
  starts_, ends_, joined_ = starts.tolist(), ends.tolist(), joined.tolist()
  covered = bytearray(count)
  chosen: list[tuple[int, int]] = []
  masked = 0
  for k, n in zip(order, lengths):
    if masked >= budget:
      break
    m = 1
    while m < n and joined_[k + m - 1]:
      m += 1
    while m and masked + ends_[k + m - 1] - starts_[k] > budget:
      m -= 1
    if not m or any(covered[k:k + m]):
      continue
    covered[k:k + m] = b"\x01" * m
    chosen.append((starts_[k], ends_[k + m - 1]))
    masked += ends_[k + m - 1] - starts_[k]
  chosen.sort()
  positions = np.concatenate([np.arange(a, b) for a, b in chosen]) if chosen else np.zeros(
      0, np.int64)
  output = array.copy()
  r_mask, r_random = gen.random(len(positions)), gen.random(len(positions))
  as_mask = r_mask < mask_token_prob
  as_random = ~as_mask & (r_random >= 1.0 - random_token_prob)
  output[positions[as_mask]] = special.mask
  output[positions[as_random]] = gen.integers(0, special.vocab_size, int(as_random.sum()))
  return output.tolist(), positions.tolist(), array[positions].tolist()


def mask_spans(tokens: Sequence[int], special: SpecialTokens,
               is_continuation: Callable[[int], bool], rng: random.Random, *, budget: int,
               geometric_p: float = 0.2, max_length: int = 10, mask_token_prob: float = 0.8,
               random_token_prob: float = 0.5) -> Masked:
  """SpanBERT's span masking: word starts in a random order (each start a uniform choice among
  those left); at each that is free, a length l ~ Geometric(p) clipped at `max_length` and a
  span of up to l whole words from there, ended early by the segment's end or by the budget
  (whole words only; a start whose first word does not fit is skipped); until `budget` tokens
  are masked. Spans never touch: a span starts and grows only where the word after it is not
  masked, so every span has unmasked boundary tokens (SpanBERT merges touching spans instead).
  Per span: every token [MASK] with `mask_token_prob`, else every token a random one with
  `random_token_prob`, else all keep theirs."""
  array = np.asarray(tokens, np.int64)
  starts, ends, joined = _words(array, special, is_continuation)
  count, gen = len(starts), _generator(rng)
  if not count or budget <= 0:
    return list(tokens), [], []
  order = gen.permutation(count).tolist()
  lengths = draw_lengths(gen, span_length_pmf(geometric_p, max_length), count).tolist()
  starts_, ends_, joined_ = starts.tolist(), ends.tolist(), joined.tolist()
  masked_word = bytearray(count + 1)  # one spare: "the word after the last" is never masked
  spans: list[tuple[int, int]] = []
  left, drawn = budget, 0
  for k in order:
    if not left:
      break
    if masked_word[k] or (k and joined_[k - 1] and masked_word[k - 1]):
      continue  # inside a span, or touching one on the left
    want = lengths[drawn]
    drawn += 1
    j, size = k, 0
    while True:
      width = ends_[j] - starts_[j]
      if size + width > left or (joined_[j] and masked_word[j + 1]):
        break  # over the budget, or the span would touch the next one
      size += width
      j += 1
      if j - k == want or not joined_[j - 1]:
        break  # its drawn length, or the segment's end
    if j == k:
      continue
    masked_word[k:j] = b"\x01" * (j - k)
    spans.append((starts_[k], ends_[j - 1]))
    left -= size
  spans.sort()
  output = array.copy()
  r_mask, r_random = gen.random(len(spans)), gen.random(len(spans))
  pieces = []
  for (a, b), rm, rr in zip(spans, r_mask.tolist(), r_random.tolist()):
    pieces.append(np.arange(a, b))
    if rm < mask_token_prob:
      output[a:b] = special.mask
    elif rr >= 1.0 - random_token_prob:
      output[a:b] = gen.integers(0, special.vocab_size, b - a)
  positions = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
  return output.tolist(), positions.tolist(), array[positions].tolist()


def span_boundary_targets(positions: Sequence[int], length: int,
                          max_offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """SpanBERT's SBO targets of sorted masked `positions` in a sequence of `length` tokens: a
  span is a maximal run of consecutive masked positions (so under span masking exactly the
  spans drawn), and each of its positions gets (s - 1, e + 1, i - s + 1), the positions of the
  tokens just before and after the span and its 1-based offset in it. A position whose span
  has no token before or after it (position 0 of a packed row, the last token) or whose
  offset exceeds `max_offset` gets (0, 0, 0): no SBO target. int32 arrays of len(positions)."""
  p = np.asarray(positions, np.int64)
  if not len(p):
    empty = np.zeros(0, np.int32)
    return empty, empty, empty
  first = np.concatenate([[True], np.diff(p) != 1])
  last = np.concatenate([first[1:], [True]])
  run = np.cumsum(first) - 1
  start, end = p[first][run], p[last][run]
  left, right, offset = start - 1, end + 1, p - start + 1
  valid = (left >= 0) & (right < length) & (offset <= max_offset)
  return tuple(np.where(valid, x, 0).astype(np.int32) for x in (left, right, offset))
