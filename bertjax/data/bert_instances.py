"""BERT pre-training instances with google-research/bert's `create_pretraining_data.py`
semantics ("fidelity mode"), on token ids: `create_instances` (every pass, as the script),
`instances_from_document` (the loader's call per document) and `mask_tokens` (also the packers').

The control flow and the order of random draws follow the reference script step for step (the
same `random.Random`, the same calls), so that given the same tokenised documents and seed the
instances themselves are the reference's. The steps: docs/data.md, 'BERT instances, fidelity
mode'.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

import numpy as np

from bertjax.data import span_masking
from bertjax.data.errors import CorpusError

Document = Sequence[Sequence[int]]  # a document is a list of sentences of token ids
# The span-boundary fields (objective mlm_sbo), aligned with masked_lm_positions.
SPAN_BOUNDARY_FIELDS = ("span_left_positions", "span_right_positions", "span_offsets")


@dataclasses.dataclass(frozen=True)
class InstanceConfig:
  max_seq_length: int = 128
  max_predictions: int = 20
  masked_lm_prob: float = 0.15
  short_seq_prob: float = 0.1
  dupe_factor: int = 10
  whole_word_mask: bool = False
  seed: int = 12345
  # Of the positions chosen, the fraction given [MASK] (google-research/bert 0.8; ELECTRA
  # 0.85; DeBERTa-v3 1.0), and of the others the fraction given a random token (BERT 0.5,
  # i.e. 10% of all; ELECTRA and DeBERTa-v3 0); the rest keep their token.
  mask_token_prob: float = 0.8
  random_token_prob: float = 0.5
  # Which positions are masked (bertjax.data.span_masking): "token" (google-research/bert,
  # pieces grouped into words by `whole_word_mask`), "ngram" (ALBERT: whole-word n-grams, n up
  # to `ngram_max` with p(n) ∝ 1/n) or "span" (SpanBERT: whole-word spans of Geometric(
  # `span_geometric_p`) length clipped at `span_max_length` words, 80/10/10 per span).
  masking: str = "token"
  ngram_max: int = 3
  span_geometric_p: float = 0.2
  span_max_length: int = 10
  # Also emit SpanBERT's span-boundary targets (objective mlm_sbo): offsets up to
  # `span_max_length` tokens, the SBO head's position table.
  span_boundary: bool = False


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  pad: int
  cls: int
  sep: int
  mask: int
  vocab_size: int


@dataclasses.dataclass
class Instance:
  tokens: list[int]
  segment_ids: list[int]
  is_random_next: bool
  masked_positions: list[int]
  masked_labels: list[int]

  def features(self, cfg: InstanceConfig, pad: int) -> dict[str, np.ndarray]:
    """google-research/bert's features, zero-padded to fixed shapes, under the batch schema's
    names (bertjax.data.schema: input_mask is attention_mask, segment_ids token_type_ids)."""
    n, p = len(self.tokens), len(self.masked_positions)
    pad_len, pad_pred = cfg.max_seq_length - n, cfg.max_predictions - p
    features = {
        "input_ids": np.array(self.tokens + [pad] * pad_len, np.int32),
        "token_type_ids": np.array(self.segment_ids + [0] * pad_len, np.int32),
        "attention_mask": np.array([1] * n + [0] * pad_len, np.int32),
        "masked_lm_positions": np.array(self.masked_positions + [0] * pad_pred, np.int32),
        "masked_lm_ids": np.array(self.masked_labels + [0] * pad_pred, np.int32),
        "masked_lm_weights": np.array([1.0] * p + [0.0] * pad_pred, np.float32),
        "next_sentence_labels": np.int32(self.is_random_next),
    }
    if cfg.span_boundary:
      # A function of the masked positions and the length alone: whatever masked them.
      targets = span_masking.span_boundary_targets(self.masked_positions, n,
                                                   cfg.span_max_length)
      for name, values in zip(SPAN_BOUNDARY_FIELDS, targets):
        features[name] = np.pad(values, (0, pad_pred))
    return features


@dataclasses.dataclass
class InstanceStats:
  """Counts for checking the output against the reference's rules."""

  documents_passed: int = 0
  short_targets: int = 0
  # B chosen at random because the chunk had one segment (the reference forces it).
  forced_random_next: int = 0
  # Chunks where a fair coin chose between the actual and a random next segment.
  coin_flips: int = 0
  coin_random_next: int = 0


def truncate_seq_pair(tokens_a: list[int], tokens_b: list[int], max_num_tokens: int,
                      rng: random.Random) -> None:
  """Trims the longer sequence (B on a tie), from the front or the back at random."""
  while len(tokens_a) + len(tokens_b) > max_num_tokens:
    trunc = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
    if rng.random() < 0.5:
      del trunc[0]
    else:
      trunc.pop()


def shuffle(x: list, rng: random.Random) -> None:
  """`rng.shuffle(x)` draw for draw (CPython's Fisher-Yates with `_randbelow` by
  `getrandbits` rejection), without a Python call per element: the loader's hot spot.
  tests/test_bert_instances.py checks it against `random.shuffle`."""
  getrandbits = rng.getrandbits
  for i in reversed(range(1, len(x))):
    n = i + 1
    k = n.bit_length()
    j = getrandbits(k)
    while j >= n:
      j = getrandbits(k)
    x[i], x[j] = x[j], x[i]


def mask_tokens(tokens: list[int], cfg: InstanceConfig, special: SpecialIds,
                is_continuation: Callable[[int], bool],
                rng: random.Random) -> tuple[list[int], list[int], list[int]]:
  """(masked tokens, sorted positions, labels) as `create_masked_lm_predictions`; with
  `cfg.masking` "ngram" or "span", ALBERT's or SpanBERT's whole-word masking instead
  (bertjax.data.span_masking), on the same budget of positions."""
  cls, sep = special.cls, special.sep
  if cfg.masking != "token":
    return _mask_words(tokens, cfg, special, is_continuation, rng)
  if cfg.whole_word_mask:
    candidates: list[list[int]] = []
    for i, token in enumerate(tokens):
      if token == cls or token == sep:
        continue
      if candidates and is_continuation(token):
        candidates[-1].append(i)
      else:
        candidates.append([i])
  else:
    return _mask_single_tokens(tokens, cfg, special, rng)
  shuffle(candidates, rng)
  output = list(tokens)
  num_to_predict = min(cfg.max_predictions,
                       max(1, int(round(len(tokens) * cfg.masked_lm_prob))))
  masked: list[tuple[int, int]] = []
  covered: set[int] = set()
  for index_set in candidates:
    if len(masked) >= num_to_predict:
      break
    if len(masked) + len(index_set) > num_to_predict:
      continue
    if any(i in covered for i in index_set):
      continue
    for i in index_set:
      covered.add(i)
      if rng.random() < cfg.mask_token_prob:
        replacement = special.mask
      elif rng.random() < 1.0 - cfg.random_token_prob:
        replacement = tokens[i]
      else:
        replacement = rng.randint(0, special.vocab_size - 1)
      output[i] = replacement
      masked.append((i, tokens[i]))
  masked.sort()
  return output, [i for i, _ in masked], [label for _, label in masked]


def _mask_single_tokens(tokens: list[int], cfg: InstanceConfig, special: SpecialIds,
                        rng: random.Random) -> tuple[list[int], list[int], list[int]]:
  """`mask_tokens` without whole-word masking, draw for draw: every candidate is one position
  and all are distinct, so the reference's loop takes the first `num_to_predict` candidates of
  the shuffle with no overshoot or overlap checks (the loader's hot path)."""
  cls, sep, mask = special.cls, special.sep, special.mask
  candidates = [i for i, token in enumerate(tokens) if token != cls and token != sep]
  shuffle(candidates, rng)  # the same draws as shuffling one-element lists
  num_to_predict = min(cfg.max_predictions,
                       max(1, int(round(len(tokens) * cfg.masked_lm_prob))))
  output = list(tokens)
  random_ = rng.random
  top = special.vocab_size - 1
  chosen = candidates[:num_to_predict]
  mask_below, random_from = cfg.mask_token_prob, 1.0 - cfg.random_token_prob
  for i in chosen:
    if random_() < mask_below:
      output[i] = mask
    elif random_() >= random_from:
      output[i] = rng.randint(0, top)
  chosen.sort()
  return output, chosen, [tokens[i] for i in chosen]


def _mask_words(tokens: list[int], cfg: InstanceConfig, special: SpecialIds,
                is_continuation: Callable[[int], bool],
                rng: random.Random) -> tuple[list[int], list[int], list[int]]:
  """`cfg.masking` "ngram" or "span" on the budget of `mask_tokens`."""
  budget = min(cfg.max_predictions, max(1, int(round(len(tokens) * cfg.masked_lm_prob))))
  probs = dict(mask_token_prob=cfg.mask_token_prob, random_token_prob=cfg.random_token_prob)
  if cfg.masking == "ngram":
    return span_masking.mask_ngrams(tokens, special, is_continuation, rng, budget=budget,
                                    ngram_max=cfg.ngram_max, **probs)
  if cfg.masking == "span":
    return span_masking.mask_spans(tokens, special, is_continuation, rng, budget=budget,
                                   geometric_p=cfg.span_geometric_p,
                                   max_length=cfg.span_max_length, **probs)
  raise ValueError(f"masking={cfg.masking!r}: choose from {', '.join(span_masking.MASKINGS)}")


# Draws of a random-next document that may land on skipped corrupt records before one is given
# up: 100 in a row happen by chance (p < 1e-30) only where nearly every record is corrupt.
_MAX_CORRUPT_DRAWS = 100


def _random_document(documents: Sequence[Document | None], index: int,
                     rng: random.Random) -> Document:
  """google-research/bert's draw of a document other than `index` (10 tries, then it keeps the
  last). A document that reads as None, a corrupt record the loader skips, is drawn again
  from the same generator, so the draws are as deterministic as the reference's and the same
  as its own where nothing is corrupt."""
  for _ in range(_MAX_CORRUPT_DRAWS):
    for _ in range(10):
      other = rng.randint(0, len(documents) - 1)
      if other != index:
        break
    document = documents[other]
    if document is not None:
      return document
  raise CorpusError(f"{_MAX_CORRUPT_DRAWS} random-next documents in a row were corrupt "
                    "records: rebuild the dataset")


def instances_from_document(documents: Sequence[Document], index: int, cfg: InstanceConfig,
                            special: SpecialIds, is_continuation: Callable[[int], bool],
                            rng: random.Random, stats: InstanceStats) -> list[Instance]:
  """`create_instances_from_document` for documents[index]."""
  document = documents[index]
  max_num_tokens = cfg.max_seq_length - 3
  target = max_num_tokens
  stats.documents_passed += 1
  if rng.random() < cfg.short_seq_prob:
    target = rng.randint(2, max_num_tokens)
    stats.short_targets += 1
  instances: list[Instance] = []
  chunk: list[Sequence[int]] = []
  length = 0
  i = 0
  while i < len(document):
    segment = document[i]
    chunk.append(segment)
    length += len(segment)
    if i == len(document) - 1 or length >= target:
      if chunk:
        a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
        tokens_a = [t for seg in chunk[:a_end] for t in seg]
        tokens_b: list[int] = []
        if len(chunk) == 1:
          stats.forced_random_next += 1
          coin = True
        else:
          coin = rng.random() < 0.5  # the reference draws only for multi-segment chunks
          stats.coin_flips += 1
          stats.coin_random_next += coin
        if coin:
          is_random_next = True
          target_b = target - len(tokens_a)
          random_document = _random_document(documents, index, rng)
          start = rng.randint(0, len(random_document) - 1)
          for j in range(start, len(random_document)):
            tokens_b.extend(random_document[j])
            if len(tokens_b) >= target_b:
              break
          i -= len(chunk) - a_end  # put the unused segments back
        else:
          is_random_next = False
          tokens_b = [t for seg in chunk[a_end:] for t in seg]
        truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
        if tokens_a and tokens_b:  # the reference asserts this; empty sentences can break it
          tokens = [special.cls] + tokens_a + [special.sep] + tokens_b + [special.sep]
          segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
          masked, positions, labels = mask_tokens(tokens, cfg, special, is_continuation, rng)
          instances.append(Instance(masked, segment_ids, is_random_next, positions, labels))
      chunk, length = [], 0
    i += 1
  return instances


def create_instances(documents: Sequence[Document], cfg: InstanceConfig, special: SpecialIds,
                     is_continuation: Callable[[int], bool] = lambda _: False,
                     stats: InstanceStats | None = None) -> list[Instance]:
  """All instances of `dupe_factor` passes over the documents, shuffled, as the reference:
  documents shuffled with `random.Random(seed)`, instances shuffled once at the end."""
  stats = InstanceStats() if stats is None else stats
  rng = random.Random(cfg.seed)
  documents = [[s for s in doc if len(s)] for doc in documents]
  documents = [doc for doc in documents if doc]
  rng.shuffle(documents)
  instances: list[Instance] = []
  for _ in range(cfg.dupe_factor):
    for index in range(len(documents)):
      instances.extend(instances_from_document(documents, index, cfg, special,
                                               is_continuation, rng, stats))
  rng.shuffle(instances)
  return instances
