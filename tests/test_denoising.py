"""The encoder-decoders' noise (bertjax.data.denoising): T5's span statistics, lengths and
sentinel order; BART's infilling and permutation on hand cases and in distribution."""

import numpy as np
import pytest

from bertjax.data import denoising


@pytest.mark.parametrize("inputs_length,density,mean,expected", [
    (512, 0.15, 3.0, (568, 114)),  # T5's C4 pre-training (t5.data random_spans_helper)
    (114, 0.15, 3.0, (126, 26)),
    (512, 0.5, 3.0, (None, None)),
])
def test_t5_lengths_fill_the_encoder_exactly(inputs_length, density, mean, expected):
  tokens, targets = denoising.t5_lengths(inputs_length, density, mean)
  if expected[0] is not None:
    assert (tokens, targets) == expected
  rng = np.random.default_rng(0)
  for _ in range(20):
    mask = denoising.random_spans_noise_mask(tokens, density, mean, rng)
    inputs, outputs = denoising.span_corruption(np.arange(tokens) + 10, mask, 999)
    # The end token each side makes them exactly the computed lengths: no padding.
    assert len(inputs) + 1 == inputs_length and len(outputs) + 1 == targets


def test_noise_mask_statistics():
  rng = np.random.default_rng(1)
  length, density, mean = 568, 0.15, 3.0
  span_lengths, first_noise = [], []
  for _ in range(300):
    mask = denoising.random_spans_noise_mask(length, density, mean, rng)
    assert mask.sum() == round(length * density)  # density exact per example: 85 of 568
    assert not mask[0]  # a gap first
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    spans = edges[1::2] - edges[0::2]
    assert len(spans) == round(85 / mean) and (spans >= 1).all()
    span_lengths.extend(spans.tolist())
    first_noise.append(int(np.argmax(mask)))
  assert np.mean(span_lengths) == pytest.approx(85 / 28)
  # Spans and gaps are random partitions: span lengths vary, and so does the first span's start.
  assert np.std(span_lengths) > 1.0 and len(set(first_noise)) > 10


def test_sentinels_count_down_in_order_and_the_pair_rebuilds_the_text():
  tokens = np.arange(100, 140)
  rng = np.random.default_rng(2)
  mask = denoising.random_spans_noise_mask(len(tokens), 0.3, 2.0, rng)
  inputs, targets = denoising.span_corruption(tokens, mask, first_sentinel=999)
  spans = int((np.diff(np.concatenate([[0], mask.astype(int)])) == 1).sum())
  assert inputs[inputs >= 990].tolist() == list(range(999, 999 - spans, -1))
  assert targets[targets >= 990].tolist() == list(range(999, 999 - spans, -1))
  # Filling each sentinel of the input with the target's span gives the original back.
  pieces, current = {}, None
  for t in targets.tolist():
    if t >= 990:
      current = t
      pieces[t] = []
    else:
      pieces[current].append(t)
  rebuilt = [x for t in inputs.tolist() for x in (pieces[t] if t >= 990 else [t])]
  assert rebuilt == tokens.tolist()


def test_span_corruption_hand_case():
  tokens = np.array([1, 2, 3, 4, 5, 6, 7, 8])
  mask = np.array([0, 1, 1, 0, 0, 1, 0, 1], bool)
  inputs, targets = denoising.span_corruption(tokens, mask, 99)
  assert inputs.tolist() == [1, 99, 4, 5, 98, 7, 97]
  assert targets.tolist() == [99, 2, 3, 98, 6, 97, 8]


class _Scripted:
  """A generator whose draws are written out: Poisson lengths, then permutations."""

  def __init__(self, poisson: list[int], permutations: list[list[int]]):
    self._poisson, self._permutations = list(poisson), [list(p) for p in permutations]

  def poisson(self, lam, size):
    out, self._poisson = self._poisson[:size], self._poisson[size:]
    return np.array(out + [0] * (size - len(out)))

  def permutation(self, x):
    order = self._permutations.pop(0)
    values = np.arange(x) if isinstance(x, int) else np.asarray(x)
    return values[[i for i in order if i < len(values)]]


M = 0


def test_text_infilling_hand_cases():
  tokens = np.arange(10, 20)
  # 30% of 10 word starts: 3 tokens' worth; lengths 2, 1 (the third draw is not needed); spans
  # start at 16 and 11: 16 becomes the mask and 17 is deleted, 11 becomes the mask.
  rng = _Scripted([2, 1, 5], [[6, 1, 0, 2, 3, 4, 5, 7, 8, 9]])
  assert denoising.text_infilling(tokens, rng, M).tolist() == [10, M, 12, 13, 14, 15, M, 18, 19]
  # A zero-length span inserts a mask; a span of 3 from 12 deletes 13 and 14.
  rng = _Scripted([0, 3], [[2, 0, 1, 3, 4, 5, 6, 7, 8, 9], [0, 5, 1, 2, 3, 4, 6, 7, 8]])
  assert denoising.text_infilling(tokens, rng, M).tolist() == [M, 10, 11, M, 15, 16, 17, 18, 19]
  # Whole words: a one-word span takes the word's continuation pieces with it.
  starts = np.array([1, 0, 1, 0, 0, 1], bool)
  rng = _Scripted([1], [[1, 0, 2]])
  assert denoising.text_infilling(np.arange(6) + 10, rng, M, mask_ratio=0.3,
                                  word_starts=starts).tolist() == [10, 11, M, 15]


def test_text_infilling_statistics():
  rng = np.random.default_rng(3)
  n, masked, masks = 1000, [], []
  for _ in range(50):
    out = denoising.text_infilling(np.arange(n) + 10, rng, M)
    masks.append(int((out == M).sum()))
    masked.append(n - int((out != M).sum()))  # tokens replaced or deleted
  # 30% of the tokens in spans (overlapping spans and inserts take a little of it), about one
  # mask per 3 tokens (Poisson(3) lengths).
  assert 0.26 < np.mean(masked) / n < 0.31
  assert 80 < np.mean(masks) < 115


def test_permute_sentences_is_a_permutation():
  sentences = [[1, 2], [3], [4, 5, 6], [7]]
  out = denoising.permute_sentences(sentences, np.random.default_rng(4))
  assert sorted(map(tuple, out)) == sorted(map(tuple, sentences)) and out != sentences
