"""Fidelity-mode BERT instances: statistics against google-research/bert's rules."""

import random

import numpy as np
import pytest

from bertjax.data.bert_instances import (InstanceConfig, InstanceStats, SpecialIds,
                                         create_instances, truncate_seq_pair)

SPECIAL = SpecialIds(pad=0, cls=2, sep=3, mask=4, vocab_size=1000)
CONTINUATION_FROM = 900  # ids >= 900 play the "##" pieces


def _corpus(num_docs=400, seed=0):
  rng = np.random.RandomState(seed)
  docs = []
  for _ in range(num_docs):
    sentences = []
    for _ in range(rng.randint(20, 80)):  # Wikipedia-like: tens of sentences
      words = []
      for _ in range(rng.randint(3, 20)):
        words.append(int(rng.randint(5, CONTINUATION_FROM)))
        words += [int(x) for x in rng.randint(CONTINUATION_FROM, 1000, rng.randint(0, 3))]
      sentences.append(words)
    docs.append(sentences)
  return docs


def _is_continuation(token):
  return token >= CONTINUATION_FROM


@pytest.fixture(scope="module", params=[False, True], ids=["token", "whole-word"])
def generated(request):
  cfg = InstanceConfig(max_seq_length=128, max_predictions=20, dupe_factor=3,
                       whole_word_mask=request.param)
  stats = InstanceStats()
  instances = create_instances(_corpus(), cfg, SPECIAL, _is_continuation, stats)
  assert len(instances) > 10_000
  return cfg, stats, instances


def _original(instance):
  tokens = list(instance.tokens)
  for position, label in zip(instance.masked_positions, instance.masked_labels):
    tokens[position] = label
  return tokens


def test_random_next_fraction(generated):
  """The coin is fair: 0.50±0.02 of the chunks it decides get a random B. Chunks of one
  segment always get a random B in the reference (len(current_chunk) == 1), which lifts the
  overall fraction above one half; it must equal exactly the forced + coin-chosen count."""
  _, stats, instances = generated
  assert stats.coin_flips > 10_000
  assert abs(stats.coin_random_next / stats.coin_flips - 0.5) <= 0.02
  random_next = sum(i.is_random_next for i in instances)
  # Pairs dropped for an empty side are rare; allow for them.
  assert abs(random_next - (stats.forced_random_next + stats.coin_random_next)) <= 5
  overall = random_next / len(instances)
  assert 0.5 <= overall <= 0.6, overall


def test_short_target_fraction(generated):
  cfg, stats, _ = generated
  assert abs(stats.short_targets / stats.documents_passed - cfg.short_seq_prob) <= 0.02


def test_masked_fraction_and_cap(generated):
  cfg, _, instances = generated
  ratios = []
  for instance in instances:
    n = len(instance.masked_positions)
    assert 1 <= n <= cfg.max_predictions
    expected = min(cfg.max_predictions, max(1, round(len(instance.tokens) * 0.15)))
    if not cfg.whole_word_mask:
      assert n == expected
    else:
      assert n <= expected
    ratios.append(n / len(instance.tokens))
  assert abs(np.mean(ratios) - 0.15) <= 0.01, np.mean(ratios)


def test_80_10_10_split(generated):
  _, _, instances = generated
  replaced = kept = masked = 0
  for instance in instances:
    for position, label in zip(instance.masked_positions, instance.masked_labels):
      token = instance.tokens[position]
      if token == SPECIAL.mask:
        masked += 1
      elif token == label:
        kept += 1
      else:
        replaced += 1
  total = masked + kept + replaced
  # A random replacement equal to the original counts as "kept" (1/vocab of the 10%).
  assert abs(masked / total - 0.8) <= 0.02
  assert abs(kept / total - 0.1) <= 0.02
  assert abs(replaced / total - 0.1) <= 0.02


def test_layout_and_no_mask_on_special_tokens(generated):
  cfg, _, instances = generated
  for instance in instances[:3000]:
    tokens = _original(instance)
    assert len(tokens) <= cfg.max_seq_length
    assert tokens[0] == SPECIAL.cls and tokens[-1] == SPECIAL.sep
    seps = [i for i, t in enumerate(tokens) if t == SPECIAL.sep]
    assert len(seps) == 2
    assert instance.segment_ids == [0] * (seps[0] + 1) + [1] * (len(tokens) - seps[0] - 1)
    assert not set(instance.masked_positions) & {0, *seps}
    assert instance.masked_positions == sorted(instance.masked_positions)
    features = instance.features(cfg, SPECIAL.pad)
    assert features["input_ids"].shape == (cfg.max_seq_length,)
    assert not np.any(features["attention_mask"][len(tokens):])
    assert features["masked_lm_weights"].sum() == len(instance.masked_positions)


def test_whole_word_masking_never_splits_a_word(generated):
  """With whole-word masking no word is partly masked; token-level masking does split words
  (so this check can tell the two apart)."""
  cfg, _, instances = generated
  split_words = 0
  for instance in instances:
    tokens = _original(instance)
    masked = set(instance.masked_positions)
    word = []
    for i, token in enumerate(tokens + [SPECIAL.sep]):
      if i < len(tokens) and _is_continuation(token) and word:
        word.append(i)
        continue
      if word:
        inside = [p in masked for p in word]
        split_words += any(inside) and not all(inside)
      word = [i] if i < len(tokens) and token not in (SPECIAL.cls, SPECIAL.sep) else []
  if cfg.whole_word_mask:
    assert split_words == 0
  else:
    assert split_words > 100


def test_truncate_seq_pair_trims_the_longer_side():
  a, b = list(range(10)), list(range(100, 104))
  truncate_seq_pair(a, b, 8, random.Random(0))
  assert len(a) + len(b) == 8 and b == [100, 101, 102, 103]
  a, b = [1, 2, 3], [4, 5, 6]  # a tie trims B
  truncate_seq_pair(a, b, 5, random.Random(0))
  assert a == [1, 2, 3] and len(b) == 2


def test_deterministic_for_a_seed():
  cfg = InstanceConfig(dupe_factor=1)
  docs = _corpus(50)
  a = create_instances(docs, cfg, SPECIAL, _is_continuation)
  b = create_instances(docs, cfg, SPECIAL, _is_continuation)
  c = create_instances(docs, InstanceConfig(dupe_factor=1, seed=1), SPECIAL, _is_continuation)
  assert [x.tokens for x in a] == [x.tokens for x in b]
  assert [x.tokens for x in a] != [x.tokens for x in c]


def test_fast_shuffle_draws_exactly_like_random_shuffle():
  from bertjax.data.bert_instances import shuffle
  for seed in range(200):
    items = list(range(seed % 150))
    a, b = list(items), list(items)
    ra, rb = random.Random(seed), random.Random(seed)
    ra.shuffle(a)
    shuffle(b, rb)
    assert a == b and ra.random() == rb.random()


def test_single_token_fast_path_equals_the_general_masking_loop():
  """Without whole-word masking a shortcut is taken; the reference's general loop (our
  whole-word path with no continuation pieces) must give the same output and draws."""
  import dataclasses
  from bertjax.data.bert_instances import InstanceConfig, mask_tokens
  cfg = InstanceConfig(max_seq_length=64, max_predictions=7)
  for seed in range(300):
    rng = random.Random(seed)
    tokens = [SPECIAL.cls] + [rng.randint(5, 99) for _ in range(rng.randint(1, 40))] + \
        [SPECIAL.sep] + [rng.randint(5, 99) for _ in range(rng.randint(1, 20))] + [SPECIAL.sep]
    ra, rb = random.Random(seed), random.Random(seed)
    fast = mask_tokens(tokens, cfg, SPECIAL, lambda _: False, ra)
    general = mask_tokens(tokens, dataclasses.replace(cfg, whole_word_mask=True), SPECIAL,
                          lambda _: False, rb)
    assert fast == general and ra.random() == rb.random()
