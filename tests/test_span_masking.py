"""ALBERT's n-gram masking, SpanBERT's span masking, span-boundary targets, head and objective
(bertjax.data.span_masking, bertjax.models.spanbert, bertjax.training.objectives): the drawn
lengths against their exact distributions, whole words only, the masking rate, 80/10/10 per
span (SpanBERT) or per token (ALBERT), SBO targets and the loss worked out by hand, and the
loader's batches with `data.masking` (host layouts, resume: tests/test_pipeline.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_helpers
from bertjax.data import schema
from bertjax.data.bert_instances import (SPAN_BOUNDARY_FIELDS, Instance, InstanceConfig,
                                         SpecialIds, mask_tokens)
from bertjax.data.options import LoaderConfig
from bertjax.data.span_masking import (ContinuationTable, draw_lengths, ngram_pmf,
                                       span_boundary_targets, span_length_pmf)

VOCAB = 30_000
SPECIAL = SpecialIds(pad=0, cls=2, sep=3, mask=4, vocab_size=VOCAB)
PIECES_FROM = 20_000  # ids >= 20,000 play the "##" pieces
CONTINUES = ContinuationTable(np.arange(VOCAB) >= PIECES_FROM)
# The chi-square distribution's 0.999 quantile for 9 and 2 degrees of freedom: a correct
# sampler fails once in a thousand seeds; the draws are seeded, so never here.
CHI2_999 = {9: 27.877, 2: 13.816}


def _chi_square(lengths: np.ndarray, pmf: np.ndarray) -> float:
  counts = np.bincount(lengths, minlength=len(pmf) + 1)[1:]
  assert counts.sum() == len(lengths)  # nothing outside 1..len(pmf)
  expected = pmf * len(lengths)
  return float(((counts - expected) ** 2 / expected).sum())


def _sequence(rng: random.Random, words: int, max_pieces: int = 2) -> list[int]:
  """Words of one id below PIECES_FROM and 0..max_pieces continuation pieces each."""
  out = []
  for _ in range(words):
    out.append(rng.randrange(5, PIECES_FROM))
    out += [rng.randrange(PIECES_FROM, VOCAB) for _ in range(rng.randint(0, max_pieces))]
  return out


def _pair(rng: random.Random, length: int = 128) -> list[int]:
  """[CLS] A [SEP] B [SEP] of about `length` tokens (pieces included)."""
  a, b = _sequence(rng, rng.randint(10, 50)), _sequence(rng, 60)
  body = (a + [SPECIAL.sep] + b)[:length - 3]
  return [SPECIAL.cls] + body + [SPECIAL.sep]


def _words(tokens: list[int]) -> list[list[int]]:
  """The positions of every whole word (a piece after [CLS]/[SEP] starts one)."""
  words: list[list[int]] = []
  after_special = True
  for i, t in enumerate(tokens):
    if t in (SPECIAL.cls, SPECIAL.sep):
      after_special = True
      continue
    if t >= PIECES_FROM and not after_special:
      words[-1].append(i)
    else:
      words.append([i])
    after_special = False
  return words


def _runs(positions: list[int]) -> list[list[int]]:
  """Maximal runs of consecutive positions."""
  runs: list[list[int]] = []
  for p in positions:
    if runs and p == runs[-1][-1] + 1:
      runs[-1].append(p)
    else:
      runs.append([p])
  return runs


def _cfg(masking: str, **kw) -> InstanceConfig:
  return InstanceConfig(**{**dict(max_seq_length=128, max_predictions=20, masking=masking), **kw})


def _masked(cfg: InstanceConfig, sequences: list[list[int]], seed: int = 0):
  rng = random.Random(seed)
  return [mask_tokens(tokens, cfg, SPECIAL, CONTINUES, rng) for tokens in sequences]


# --- the length distributions -----------------------------------------------------------------


def test_span_lengths_are_geometric_clipped_at_the_max_length():
  pmf = span_length_pmf(0.2, 10)
  want = np.array([0.2 * 0.8 ** (l - 1) for l in range(1, 11)]) / (1 - 0.8 ** 10)
  np.testing.assert_allclose(pmf, want, rtol=1e-12)
  # Joshi et al. 2020, §3.1: "a mean span length of 3.8".
  assert abs(float((np.arange(1, 11) * pmf).sum()) - 3.8) < 0.01
  lengths = draw_lengths(np.random.default_rng(0), pmf, 200_000)
  assert _chi_square(lengths, pmf) < CHI2_999[9]
  # The statistic tells a nearby distribution apart: Geometric(0.2) cut at 10 without
  # renormalising (the tail lumped on 10) and Geometric(0.22).
  lumped = want * (1 - 0.8 ** 10)
  lumped[-1] += 0.8 ** 10
  assert _chi_square(lengths, lumped) > 100 * CHI2_999[9]
  assert _chi_square(lengths, span_length_pmf(0.22, 10)) > 10 * CHI2_999[9]


def test_ngram_lengths_favour_short_ngrams():
  pmf = ngram_pmf(3)
  np.testing.assert_allclose(pmf, np.array([1, 1 / 2, 1 / 3]) / (11 / 6), rtol=1e-12)
  lengths = draw_lengths(np.random.default_rng(1), pmf, 100_000)
  assert _chi_square(lengths, pmf) < CHI2_999[2]
  assert _chi_square(lengths, np.full(3, 1 / 3)) > 100 * CHI2_999[2]


def _sparse_runs(masking: str, sequences: int = 500) -> np.ndarray:
  """Run lengths of the masking's output on long one-piece-word sequences with a small budget
  (1% of 20,000 words): nearly every drawn span or n-gram is whole and alone, so the lengths
  seen are the lengths drawn."""
  rng = random.Random(7)
  tokens = [SPECIAL.cls] + [rng.randrange(5, PIECES_FROM) for _ in range(20_000)] + [SPECIAL.sep]
  cfg = _cfg(masking, max_seq_length=len(tokens), max_predictions=200, masked_lm_prob=0.01)
  lengths = []
  for seed in range(sequences):
    _, positions, _ = mask_tokens(tokens, cfg, SPECIAL, CONTINUES, random.Random(seed))
    assert len(positions) == 200
    lengths += [len(run) for run in _runs(positions)]
  return np.array(lengths)


def test_masked_spans_have_the_clipped_geometric_lengths():
  lengths = _sparse_runs("span")
  assert len(lengths) > 20_000 and lengths.max() <= 10
  frequencies = np.bincount(lengths, minlength=11)[1:] / len(lengths)
  np.testing.assert_allclose(frequencies, span_length_pmf(0.2, 10), atol=0.01)


def test_masked_ngrams_have_lengths_in_proportion_to_one_over_n():
  lengths = _sparse_runs("ngram")
  frequencies = np.bincount(lengths, minlength=4)[1:4] / len(lengths)
  np.testing.assert_allclose(frequencies, ngram_pmf(3), atol=0.015)
  assert (lengths > 3).mean() < 0.02  # only where two n-grams happen to touch


# --- the masks on realistic sequences ---------------------------------------------------------


@pytest.fixture(scope="module")
def pairs() -> list[list[int]]:
  rng = random.Random(3)
  return [_pair(rng) for _ in range(3000)]


@pytest.mark.parametrize("masking", ["span", "ngram"])
def test_whole_words_only_and_the_masking_rate(pairs, masking):
  """Never a special token, never part of a word (token-level masking on the same sequences
  does split words), 15% of the tokens within the max_predictions cap."""
  split = {}
  for name in (masking, "token"):
    cfg = _cfg(name)
    split[name], rates = 0, []
    for tokens, (output, positions, labels) in zip(pairs, _masked(cfg, pairs)):
      budget = min(cfg.max_predictions, max(1, round(len(tokens) * cfg.masked_lm_prob)))
      assert positions == sorted(set(positions)) and len(positions) <= budget
      assert labels == [tokens[p] for p in positions]
      assert all(output[i] == t for i, t in enumerate(tokens) if i not in set(positions))
      assert not {SPECIAL.cls, SPECIAL.sep} & {tokens[p] for p in positions}
      masked = set(positions)
      split[name] += sum(0 < sum(p in masked for p in w) < len(w) for w in _words(tokens))
      rates.append(len(positions) / len(tokens))
    assert abs(np.mean(rates) - 0.15) < 0.01, (name, np.mean(rates))
  assert split[masking] == 0 and split["token"] > 1000


def _kinds(tokens, output, run) -> set[str]:
  return {"mask" if output[p] == SPECIAL.mask else "kept" if output[p] == tokens[p] else "random"
          for p in run}


def test_span_masking_decides_80_10_10_per_span(pairs):
  """Every span is all [MASK], all random or all kept, in 0.8/0.1/0.1 of the spans; ALBERT's
  n-grams decide per token, so their runs mix (the check tells the two apart)."""
  counts = {"mask": 0, "kept": 0, "random": 0}
  for tokens, (output, positions, _) in zip(pairs, _masked(_cfg("span"), pairs)):
    for run in _runs(positions):
      kinds = _kinds(tokens, output, run)
      assert len(kinds) == 1, (run, kinds)
      counts[kinds.pop()] += 1
  total = sum(counts.values())
  assert total > 10_000
  assert abs(counts["mask"] / total - 0.8) < 0.02
  assert abs(counts["kept"] / total - 0.1) < 0.02
  assert abs(counts["random"] / total - 0.1) < 0.02
  mixed = sum(len(_kinds(tokens, output, run)) > 1
              for tokens, (output, positions, _) in zip(pairs, _masked(_cfg("ngram"), pairs))
              for run in _runs(positions))
  assert mixed > 500


def test_ngram_masking_decides_80_10_10_per_token(pairs):
  counts = {"mask": 0, "kept": 0, "random": 0}
  for tokens, (output, positions, _) in zip(pairs, _masked(_cfg("ngram"), pairs)):
    for p in positions:
      counts[_kinds(tokens, output, [p]).pop()] += 1
  total = sum(counts.values())
  assert abs(counts["mask"] / total - 0.8) < 0.02
  assert abs(counts["kept"] / total - 0.1) < 0.02
  assert abs(counts["random"] / total - 0.1) < 0.02


def test_spans_never_touch_and_stay_in_their_segment(pairs):
  """Each span is a run of at most 10 whole words with an unmasked token on both sides (so its
  SBO boundaries are real tokens), inside one segment."""
  for tokens, (_, positions, _) in zip(pairs, _masked(_cfg("span"), pairs)):
    starts = {w[0] for w in _words(tokens)}
    masked = set(positions)
    for run in _runs(positions):
      assert run[0] in starts and run[-1] + 1 not in masked and run[0] - 1 not in masked
      assert run[-1] + 1 in starts or tokens[run[-1] + 1] in (SPECIAL.cls, SPECIAL.sep)
      assert sum(p in starts for p in run) <= 10


def test_masks_are_a_function_of_the_seed(pairs):
  for masking in ("span", "ngram"):
    cfg = _cfg(masking)
    assert _masked(cfg, pairs[:50], seed=1) == _masked(cfg, pairs[:50], seed=1)
    assert _masked(cfg, pairs[:50], seed=1) != _masked(cfg, pairs[:50], seed=2)


def test_bad_masking_settings_are_one_line_errors_naming_the_key():
  base = dict(dataset="d", objective="mlm", seq_length=32)
  for key, value, match in (("masking", "spans",
                             "data.masking='spans': choose from token, ngram, span"),
                            ("ngram_max", 0, "data.ngram_max=0"),
                            ("span_geometric_p", 0.0, "data.span_geometric_p=0.0"),
                            ("span_geometric_p", 1.5, "data.span_geometric_p=1.5"),
                            ("span_max_length", 0, "data.span_max_length=0")):
    with pytest.raises(ValueError, match=match) as error:
      LoaderConfig(**base, **{key: value})
    assert "\n" not in str(error.value)
  LoaderConfig(**base, masking="span", span_geometric_p=1.0, span_max_length=1)


# --- span-boundary targets --------------------------------------------------------------------


def test_span_boundary_targets_worked_out_by_hand():
  """[CLS] the quick brown fox ##es jump ##ed over the dog [SEP]
      0     1   2     3     4   5    6    7    8    9   10  11
  masked: "the" (1), "brown fox ##es" (3-5), "dog" (10)."""
  positions = [1, 3, 4, 5, 10]
  left, right, offset = span_boundary_targets(positions, 12, max_offset=10)
  np.testing.assert_array_equal(left, [0, 2, 2, 2, 9])  # [CLS] is the first span's left
  np.testing.assert_array_equal(right, [2, 6, 6, 6, 11])  # [SEP] the last one's right
  np.testing.assert_array_equal(offset, [1, 1, 2, 3, 1])
  assert left.dtype == right.dtype == offset.dtype == np.int32
  # Offsets past the head's rows have no target; nor do spans at a packed row's edges (a row
  # that starts or ends mid-document has no token before position 0 or after the last).
  left, right, offset = span_boundary_targets(positions, 12, max_offset=2)
  np.testing.assert_array_equal(offset, [1, 1, 2, 0, 1])
  np.testing.assert_array_equal(left, [0, 2, 2, 0, 9])
  left, right, offset = span_boundary_targets([0, 1, 5, 11], 12, max_offset=10)
  np.testing.assert_array_equal(np.stack([left, right, offset]),
                                [[0, 0, 4, 0], [0, 0, 6, 0], [0, 0, 1, 0]])
  assert all(len(x) == 0 for x in span_boundary_targets([], 12, 10))
  # As features: aligned with masked_lm_positions, zero-padded to max_predictions.
  tokens = list(range(20, 32))
  cfg = InstanceConfig(max_seq_length=16, max_predictions=7, span_boundary=True)
  features = Instance(tokens, [0] * 12, False, positions, [tokens[p] for p in positions]
                      ).features(cfg, SPECIAL.pad)
  np.testing.assert_array_equal(features["span_left_positions"], [0, 2, 2, 2, 9, 0, 0])
  np.testing.assert_array_equal(features["span_right_positions"], [2, 6, 6, 6, 11, 0, 0])
  np.testing.assert_array_equal(features["span_offsets"], [1, 1, 2, 3, 1, 0, 0])
  assert all(features[k].dtype == np.int32 for k in SPAN_BOUNDARY_FIELDS)
  plain = Instance(tokens, [0] * 12, False, positions, [0] * 5).features(
      dataclasses.replace(cfg, span_boundary=False), SPECIAL.pad)
  assert not set(SPAN_BOUNDARY_FIELDS) & set(plain)


def test_span_boundary_targets_of_masked_spans(pairs):
  """On span masking's output every masked token gets its span's unmasked neighbours and its
  offset from the span's first token, none deeper than span_max_length tokens."""
  cfg = _cfg("span", span_boundary=True)
  with_target = 0
  for tokens, (output, positions, labels) in zip(pairs[:500], _masked(cfg, pairs[:500])):
    features = Instance(output, [0] * len(output), False, positions, labels).features(
        cfg, SPECIAL.pad)
    masked = set(positions)
    for i, p in enumerate(positions):
      run = next(r for r in _runs(positions) if p in r)
      left, right = features["span_left_positions"][i], features["span_right_positions"][i]
      offset = features["span_offsets"][i]
      if p - run[0] + 1 > cfg.span_max_length:
        assert offset == left == right == 0
        continue
      assert (left, right, offset) == (run[0] - 1, run[-1] + 1, p - run[0] + 1)
      assert left not in masked and right not in masked and right < len(tokens)
      with_target += 1
  assert with_target > 5000


# --- the SBO head and the objective -----------------------------------------------------------


def _tiny_model(max_span_length: int = 10):
  from bertjax.models.config import ModelConfig
  from bertjax.models.spanbert import SpanBertForPreTraining
  config = ModelConfig(family="bert", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                       mlp_dim=32, max_positions=16)
  return SpanBertForPreTraining(config, max_span_length=max_span_length)


def _gelu(x: np.ndarray) -> np.ndarray:
  return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _layer_norm(x, p, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def test_sbo_head_shapes_parameters_and_its_formula():
  """Logits [B, P, V]; the parameters are BertForPreTraining's (same MLM logits) plus `sbo`,
  all with logical axes; the SBO logits equal y = LN(GeLU(W2 LN(GeLU(W1 [x_l; x_r; p])))) fed
  through the tied embeddings and the MLM bias, computed here in numpy."""
  import flax.linen as nn
  from bertjax.models import init_params
  from bertjax.models.bert import BertForPreTraining
  model = _tiny_model()
  boxed = jax.jit(lambda r: init_params(model, r))(jax.random.key(0))
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert all(isinstance(x, nn.Partitioned) for x in leaves)
  params = nn.meta.unbox(boxed)
  # Every parameter perturbed: zero-initialised biases and LayerNorm offsets would hide a
  # term left out.
  rng = np.random.RandomState(3)
  params = jax.tree.map(lambda x: np.asarray(x) + np.float32(0.1) * rng.standard_normal(
      x.shape).astype(np.float32), params)
  shapes = jax.tree.map(lambda x: x.shape, params["sbo"])
  assert shapes == {"position_embeddings": {"embedding": (10, 16)},
                    "dense1": {"kernel": (48, 16), "bias": (16,)},
                    "dense2": {"kernel": (16, 16), "bias": (16,)},
                    "norm1": {"scale": (16,), "bias": (16,)},
                    "norm2": {"scale": (16,), "bias": (16,)}}
  bert_only = {k: v for k, v in params.items() if k != "sbo"}
  assert jax.tree.map(lambda x: x.shape, bert_only) == jax.tree.map(
      lambda x: x.shape, jax.eval_shape(lambda r: nn.meta.unbox(
          init_params(BertForPreTraining(model.config), r)), jax.random.key(0)))
  ids = jax.random.randint(jax.random.key(1), (2, 12), 5, 64)
  positions = jnp.array([[3, 4, 8], [5, 6, 0]])
  left, right = jnp.array([[2, 2, 7], [4, 4, 0]]), jnp.array([[5, 5, 9], [7, 7, 0]])
  offsets = jnp.array([[1, 2, 1], [1, 2, 0]])
  # Jitted: op by op, the model's apply costs ~30 s of dispatch on 2 cores.
  out = jax.jit(model.apply, static_argnums=(5,))(
      {"params": params}, ids, None, None, positions, True, None, None, left, right, offsets)
  assert out.sbo_logits.shape == out.mlm_logits.shape == (2, 3, 64)
  assert out.sbo_logits.dtype == jnp.float32
  mlm = jax.jit(BertForPreTraining(model.config).apply)({"params": bert_only}, ids, None, None,
                                                         positions)
  np.testing.assert_array_equal(out.mlm_logits, mlm.mlm_logits)
  p = jax.tree.map(np.asarray, params)
  sbo, x = p["sbo"], np.asarray(out.sequence)
  rows = np.arange(2)[:, None]
  h = np.concatenate([x[rows, np.asarray(left)], x[rows, np.asarray(right)],
                      sbo["position_embeddings"]["embedding"][np.maximum(offsets - 1, 0)]], -1)
  eps = model.config.layer_norm_eps
  h = _layer_norm(_gelu(h @ sbo["dense1"]["kernel"] + sbo["dense1"]["bias"]), sbo["norm1"], eps)
  y = _layer_norm(_gelu(h @ sbo["dense2"]["kernel"] + sbo["dense2"]["bias"]), sbo["norm2"], eps)
  want = y @ p["bert"]["word_embeddings"]["embedding"].T + p["mlm_bias"]
  np.testing.assert_allclose(out.sbo_logits, want, atol=2e-5, rtol=1e-5)
  # Without span inputs (initialisation) the head still runs, on one dummy slot.
  assert jax.jit(model.apply)({"params": params}, ids).sbo_logits.shape == (2, 1, 64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.slow
def test_objective_loss_equals_a_hand_computation():
  """loss = Σ w·NLL_mlm / Σ w + Σ w'·NLL_sbo / Σ w', where w' drops the slots without an SBO
  target (offset 0) and those deeper than the head's rows; accuracies likewise."""
  import flax.linen as nn
  from bertjax.models import init_params
  from bertjax.training.objectives import SpanBoundaryPretraining
  model = _tiny_model(max_span_length=3)
  params = nn.meta.unbox(jax.jit(lambda r: init_params(model, r))(jax.random.key(0)))
  objective = SpanBoundaryPretraining(model)
  batch = {
      "input_ids": np.asarray(jax.random.randint(jax.random.key(2), (2, 12), 5, 64), np.int32),
      "token_type_ids": np.zeros((2, 12), np.int32),
      "attention_mask": np.ones((2, 12), np.int32),
      "masked_lm_positions": np.array([[2, 3, 4, 5], [7, 0, 0, 0]], np.int32),
      "masked_lm_ids": np.array([[10, 11, 12, 13], [14, 0, 0, 0]], np.int32),
      "masked_lm_weights": np.array([[1, 1, 1, 1], [1, 0, 0, 0]], np.float32),
      "next_sentence_labels": np.zeros(2, np.int32),
      "span_left_positions": np.array([[1, 1, 1, 1], [0, 0, 0, 0]], np.int32),
      "span_right_positions": np.array([[6, 6, 6, 6], [0, 0, 0, 0]], np.int32),
      # 4 > the head's 3 rows, and row 1's span touches the row's start: no SBO target.
      "span_offsets": np.array([[1, 2, 3, 4], [0, 0, 0, 0]], np.int32),
  }
  schema.check(batch, "mlm_sbo")
  # Loss, metrics and gradients from one jitted call (the objective runs once).
  (loss, metrics), grads = jax.jit(jax.value_and_grad(
      lambda p, b: objective(p, b, objective.normalizers(b), None), has_aux=True))(params, batch)
  out = jax.jit(lambda p, b: model.apply(
      {"params": p}, b["input_ids"], b["token_type_ids"], b["attention_mask"],
      b["masked_lm_positions"], True, None, None, b["span_left_positions"],
      b["span_right_positions"], b["span_offsets"]))(params, batch)
  ids = batch["masked_lm_ids"]

  def nll(logits):
    log_p = _log_softmax(np.asarray(logits, np.float64))
    return -np.take_along_axis(log_p, ids[..., None], -1)[..., 0]

  w = batch["masked_lm_weights"]
  w_sbo = np.array([[1, 1, 1, 0], [0, 0, 0, 0]], np.float64)
  mlm = (w * nll(out.mlm_logits)).sum() / w.sum()
  sbo = (w_sbo * nll(out.sbo_logits)).sum() / w_sbo.sum()
  assert float(metrics["mlm_loss"]) == pytest.approx(mlm, rel=1e-5)
  assert float(metrics["sbo_loss"]) == pytest.approx(sbo, rel=1e-5)
  assert float(loss) == pytest.approx(mlm + sbo, rel=1e-5)
  correct = np.argmax(np.asarray(out.sbo_logits), -1) == ids
  assert float(metrics["sbo_accuracy"]) == pytest.approx((w_sbo * correct).sum() / 3)
  correct = np.argmax(np.asarray(out.mlm_logits), -1) == ids
  assert float(metrics["mlm_accuracy"]) == pytest.approx((w * correct).sum() / 5)
  assert set(metrics) == {"mlm_loss", "mlm_accuracy", "sbo_loss", "sbo_accuracy"}
  assert float(jnp.abs(grads["sbo"]["dense1"]["kernel"]).sum()) > 0


@pytest.mark.slow
def test_sharded_training_steps_match_one_device_layout():
  """mlm_sbo trains the same on a (2, 2, 2) data/fsdp/tensor mesh, with 1 or 2 micro-batches,
  as on pure data parallelism: losses and gradient norms of 3 steps (the SBO head's pinned
  layout; without it the (2, 2, 2) gradients of whole batches are ~1% off)."""
  runs = []
  for axes, accum in (((8, 1, 1), 1), ((2, 2, 2), 1), ((2, 2, 2), 2)):
    config = train_helpers.tiny_config("bert", objective="mlm_sbo", grad_accum_steps=accum,
                                       **{"model.span_boundary_positions": 10})
    _, _, history = train_helpers.run_steps(config, axes, steps=3)
    runs.append([(h["loss"], h["grad_norm"], h["sbo_loss"]) for h in history])
  np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)
  np.testing.assert_allclose(runs[2], runs[0], rtol=1e-5)
  assert all(np.isfinite(runs[0]).ravel())


# --- the loader, the synthetic source, the config ---------------------------------------------


WORDS = [f"w{i}" for i in range(150)]
PIECES = ["##a", "##b", "##c"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
  """A built dataset whose words are often several WordPiece pieces ("w7ab" -> w7 ##a ##b)."""
  from bertjax.data.build import build_dataset
  from bertjax.data.options import BuildOptions
  from bertjax.data.sources import parse_source
  root = tmp_path_factory.mktemp("spans")
  rng = random.Random(5)
  docs = [[" ".join(rng.choice(WORDS) + "".join(rng.choice("abc") for _ in range(
      rng.choice((0, 0, 1, 2)))) for _ in range(rng.randint(4, 14))) + " ."
           for _ in range(rng.randint(2, 9))] for _ in range(80)]
  train_helpers.write_bert_lines(root / "a.txt", docs)
  train_helpers.write_vocab(root / "vocab.txt", WORDS + PIECES)
  build_dataset([parse_source(f"bert_lines:{root / 'a.txt'}?name=a")], root / "vocab.txt",
                root / "data", BuildOptions(num_shards=2, eval_fraction=0.1))
  return root / "data"


@pytest.mark.parametrize("instances", ["doc_sentences", "packed", "pairs", "full_sentences"])
def test_loader_batches_carry_whole_word_spans_and_their_sbo_targets(dataset, instances):
  from bertjax.data.pipeline import CorpusBatches
  from bertjax.data.streams import dataset_tokenizer
  from bertjax.data.records import BuiltDataset
  cfg = LoaderConfig(dataset=str(dataset), objective="mlm_sbo", seq_length=48,
                     max_predictions=8, masking="span", bert_instances=instances, prefetch=0)
  tokenizer = dataset_tokenizer(BuiltDataset.open(dataset))
  batches = CorpusBatches(cfg, "train", range(4), 4)
  spans = pieces = 0
  for _ in range(12):
    batch = next(batches)
    schema.check(batch, "mlm_sbo")
    assert set(batch) == {f.name for f in schema.fields("mlm_sbo", instances == "packed")}
    for row in range(4):
      n = int(batch["attention_mask"][row].sum())
      w = batch["masked_lm_weights"][row] > 0
      positions = batch["masked_lm_positions"][row][w].tolist()
      targets = span_boundary_targets(positions, n, cfg.span_max_length)
      for name, values in zip(SPAN_BOUNDARY_FIELDS, targets):
        np.testing.assert_array_equal(batch[name][row][w], values)
        assert not batch[name][row][~w].any()
      tokens = batch["input_ids"][row].copy()
      tokens[positions] = batch["masked_lm_ids"][row][w]
      masked = set(positions)
      for run in _runs(positions):  # whole words: no piece continues a span's last word
        assert run[-1] + 1 not in masked
        assert run[-1] + 1 >= n or not tokenizer.is_continuation(int(tokens[run[-1] + 1]))
        assert run[0] == 0 or not tokenizer.is_continuation(int(tokens[run[0]])) or (
            tokens[run[0] - 1] in (2, 3))
        spans += 1
      pieces += sum(tokenizer.is_continuation(int(tokens[p])) for p in positions)
  batches.close()
  assert spans > 80 and pieces > 20  # words of several pieces were masked whole


def test_synthetic_batches_for_mlm_sbo_fit_the_schema():
  from bertjax.data import make_batches
  config = train_helpers.tiny_config("bert", objective="mlm_sbo")
  batch = next(make_batches(config, "train", range(4)))
  schema.check(batch, "mlm_sbo")
  w = batch["masked_lm_weights"] > 0
  for row in range(4):
    targets = span_boundary_targets(batch["masked_lm_positions"][row][w[row]].tolist(),
                                    config.seq_length, 10)
    np.testing.assert_array_equal(batch["span_offsets"][row][w[row]], targets[2])


def test_run_config_masking_keys_reach_the_loader():
  from bertjax.config import base_config, bert_model
  from bertjax.data import loader_config
  config = base_config(bert_model())
  config.objective = "mlm_sbo"
  defaults = loader_config(config, "d")
  assert (defaults.masking, defaults.ngram_max, defaults.span_geometric_p,
          defaults.span_max_length) == ("token", 3, 0.2, 10)
  for key, value in (("masking", "span"), ("ngram_max", 4), ("span_geometric_p", 0.3),
                     ("span_max_length", 6)):
    config.data[key] = value
  cfg = loader_config(config, "d")
  assert (cfg.masking, cfg.ngram_max, cfg.span_geometric_p, cfg.span_max_length) == (
      "span", 4, 0.3, 6)


def test_spanbert_config_has_the_papers_values():
  path = Path(__file__).resolve().parent.parent / "configs" / "spanbert.py"
  # The file's own values, read without load_config's overrides and validation.
  spec = importlib.util.spec_from_file_location("spanbert_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for size, (layers, width, heads, ffn) in {"base": (12, 768, 12, 3072),
                                            "large": (24, 1024, 16, 4096)}.items():
    config = module.get_config(f"size={size}")
    m = config.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.mlp_dim, m.vocab_size) == (
        layers, width, heads, ffn, 28_996)
    assert config.objective == "mlm_sbo" and config.data.bert_instances == "doc_sentences"
    assert (config.data.masking, config.data.span_geometric_p, config.data.span_max_length,
            config.data.mask_prob, config.data.dupe_factor) == ("span", 0.2, 10, 0.15, 0)
    assert (config.batch_size, config.seq_length, config.num_train_steps) == (256, 512,
                                                                              2_400_000)
    o = config.optimizer
    assert (o.name, o.learning_rate, o.warmup_steps, o.schedule, o.weight_decay, o.eps,
            o.clip_norm) == ("adamw", 1e-4, 10_000, "linear", 0.01, 1e-8, 1.0)
    LoaderConfig(dataset="d", objective=config.objective, seq_length=config.seq_length,
                 masking=config.data.masking, span_geometric_p=config.data.span_geometric_p,
                 span_max_length=config.data.span_max_length)
