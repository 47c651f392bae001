"""The encoder-decoders' noise: T5's span corruption (Raffel et al. 2020, Section 3.1.4 and
Table 4) and BART's text infilling and sentence permutation (Lewis et al. 2020, Section 2.2), as
functions of a token sequence and a NumPy generator (the loader seeds one per example).

T5's follows t5.data.preprocessors (`t5_lengths`: its random_spans_helper, so that no position
is padding); BART's follows fairseq's DenoisingDataset. Sentinels count down from the last id of
the vocabulary (<extra_id_0> is vocab_size - 1, as T5's vocabularies).

The guide: docs/data.md, 'Encoder-decoder examples'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def _t5_output_lengths(tokens_length: int, noise_density: float,
                       mean_span_length: float) -> tuple[int, int]:
  """(encoder input, decoder target) lengths of `tokens_length` raw tokens, each with its end
  token: the non-noise tokens and one sentinel per span; the noise tokens and one sentinel per
  span."""
  noise = int(round(tokens_length * noise_density))
  spans = int(round(noise / mean_span_length))
  return tokens_length - noise + spans + 1, noise + spans + 1


def t5_lengths(inputs_length: int, noise_density: float = 0.15,
               mean_span_length: float = 3.0) -> tuple[int, int]:
  """(raw tokens per example, decoder target length): the most raw tokens whose corrupted
  input fits `inputs_length` (T5's random_spans_helper)."""
  tokens_length = inputs_length - 1
  while _t5_output_lengths(tokens_length + 1, noise_density, mean_span_length)[0] <= inputs_length:
    tokens_length += 1
  _, targets_length = _t5_output_lengths(tokens_length, noise_density, mean_span_length)
  if noise_density == 0.5 and targets_length > inputs_length:
    tokens_length -= 1  # T5's: targets as long as inputs, a rounder number
    targets_length -= 1
  return tokens_length, targets_length


def _random_segmentation(num_items: int, num_segments: int,
                         rng: np.random.Generator) -> np.ndarray:
  """`num_items` split into `num_segments` non-empty runs at random: the runs' lengths."""
  first_in_segment = np.zeros(num_items, np.int64)
  first_in_segment[1:] = rng.permutation(np.arange(num_items - 1) < num_segments - 1)
  segment_id = np.cumsum(first_in_segment)
  return np.bincount(segment_id, minlength=num_segments)


# T5's random_spans_noise_mask, noise_span_to_unique_sentinel and nonnoise_span_to_unique_sentinel
# (t5.data.preprocessors).
def random_spans_noise_mask(length: int, noise_density: float, mean_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
  """A bool mask of `length`: round(length * density) noise tokens (at least 1, at most
  length - 1) in round(noise / mean_span_length) spans (at least 1), spans and the gaps
  between them of random lengths, starting with a gap."""
  original_length = length
  length = max(length, 2)
  num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
  num_spans = max(int(round(num_noise / mean_span_length)), 1)
  noise_lengths = _random_segmentation(num_noise, num_spans, rng)
  gap_lengths = _random_segmentation(length - num_noise, num_spans, rng)
  interleaved = np.stack([gap_lengths, noise_lengths], axis=1).reshape(-1)
  span_starts = np.cumsum(interleaved)[:-1]
  indicator = np.zeros(length, np.int64)
  indicator[span_starts] = 1
  is_noise = np.cumsum(indicator) % 2 == 1
  return is_noise[:original_length]


def _spans_to_sentinels(tokens: np.ndarray, mask: np.ndarray, first_sentinel: int) -> np.ndarray:
  """Each run of masked tokens replaced by one sentinel, counting down from `first_sentinel`."""
  previous = np.concatenate([[False], mask[:-1]])
  first = mask & ~previous
  sentinels = first_sentinel + 1 - np.cumsum(first)
  out = np.where(first, sentinels, tokens)
  return out[~(mask & previous)]


def span_corruption(tokens: np.ndarray, noise_mask: np.ndarray,
                    first_sentinel: int) -> tuple[np.ndarray, np.ndarray]:
  """(encoder input, decoder target), without end tokens: the input keeps the non-noise
  tokens with a sentinel for each noise span; the target holds each noise span behind its
  sentinel (the same sentinel ids, in the same order)."""
  tokens = np.asarray(tokens)
  return (_spans_to_sentinels(tokens, noise_mask, first_sentinel),
          _spans_to_sentinels(tokens, ~noise_mask, first_sentinel))


# fairseq's DenoisingDataset.add_whole_word_mask with mask_length="span-poisson" and
# replace_length=1 (BART's settings); the mask ratio is of the word-start tokens.
def text_infilling(tokens: np.ndarray, rng: np.random.Generator, mask_id: int,
                   mask_ratio: float = 0.3, poisson_lambda: float = 3.0,
                   word_starts: np.ndarray | None = None) -> np.ndarray:
  """BART's infilling noise of one sequence (no special tokens in it): ceil(mask_ratio x
  word starts) tokens' worth of spans, Poisson(lambda) long, each starting at a word start and
  replaced by one `mask_id`; zero-length spans insert a `mask_id` at random positions.
  `word_starts`: bool per token (default: every token starts a word)."""
  tokens = np.asarray(tokens)
  n = len(tokens)
  starts = np.ones(n, bool) if word_starts is None else np.asarray(word_starts, bool).copy()
  budget = int(math.ceil(starts.sum() * mask_ratio))
  if budget == 0 or n == 0:
    return tokens.copy()
  lengths = rng.poisson(poisson_lambda, budget)
  while lengths.sum() < budget:
    lengths = np.concatenate([lengths, rng.poisson(poisson_lambda, budget)])
  cumulative = np.cumsum(lengths)
  last = int(np.searchsorted(cumulative, budget))  # the first span reaching the budget
  lengths = lengths[:last + 1].copy()
  lengths[last] = budget - (cumulative[last - 1] if last else 0)
  num_inserts = int((lengths == 0).sum())
  lengths = lengths[lengths > 0]
  keep = np.ones(n, bool)
  out = tokens.copy()
  candidates = np.flatnonzero(starts)
  chosen = rng.permutation(candidates)[:len(lengths)]
  lengths = lengths[:len(chosen)]
  for start, length in zip(chosen.tolist(), lengths.tolist()):
    out[start] = mask_id
    # The span runs over `length` words: to the end of the word where the count runs out.
    position, words = start + 1, 1
    while position < n and (words < length or not starts[position]):
      words += int(starts[position])
      keep[position] = False
      position += 1
  out = out[keep]
  if num_inserts:
    out = _insert_masks(out, num_inserts, rng, mask_id)
  return out


def _insert_masks(tokens: np.ndarray, count: int, rng: np.random.Generator,
                  mask_id: int) -> np.ndarray:
  """`count` mask tokens inserted at distinct random positions of the result."""
  total = len(tokens) + count
  at = np.sort(rng.permutation(total)[:count])
  out = np.empty(total, tokens.dtype)
  is_mask = np.zeros(total, bool)
  is_mask[at] = True
  out[is_mask] = mask_id
  out[~is_mask] = tokens
  return out


# permute_sentence_ratio 1.0: every document's sentences are shuffled.
def permute_sentences(sentences: Sequence[Sequence[int]],
                      rng: np.random.Generator) -> list[list[int]]:
  """The sentences in a random order (BART's sentence permutation)."""
  return [list(sentences[i]) for i in rng.permutation(len(sentences))]
