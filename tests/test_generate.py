"""Generation: KV-cache decoding equals full recomputation; greedy and beam search
equal `transformers`' `generate` on the same GPT-2 weights; sampling is seeded; fill-mask
equals the `transformers` fill-mask pipeline."""

import hf_models
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.inference import generate as gen
from bertjax import hf
from bertjax.data.wordpiece import WordPiece
from bertjax.models import ModelConfig, build_model, jit_init
from train_helpers import uncached_greedy

torch = hf_models.torch
transformers = hf_models.transformers

PROMPTS = [[5, 17, 3, 44, 9, 61, 2], [70, 12], [33, 8, 91, 4]]


def _gpt(scan: bool, seed: int = 0):
  """A GPT-2-shaped model whose weights are far from the 0.02 init, so greedy, beam search and
  the length penalty give different, non-degenerate continuations."""
  cfg = ModelConfig(family="gpt", vocab_size=97, hidden_size=48, num_layers=2, num_heads=4,
                    mlp_dim=192, max_positions=40, type_vocab_size=0, norm_position="pre",
                    activation="gelu_tanh", layer_norm_eps=1e-5, scan_layers=scan)
  params = jit_init(build_model(cfg))(jax.random.key(seed))
  rng = np.random.RandomState(seed)
  params = jax.tree.map(lambda x: np.asarray(x) + 0.3 * rng.standard_normal(x.shape)
                        .astype(np.float32), params)
  return params, cfg




@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_cached_greedy_equals_full_recomputation(scan):
  params, cfg = _gpt(scan)
  steps = 10
  got = gen.generate(params, cfg, PROMPTS, max_new_tokens=steps)
  expected = [uncached_greedy(params, cfg, p, steps) for p in PROMPTS]
  assert got == expected
  assert len({tuple(r) for r in got}) > 1 and all(len(set(r)) > 1 for r in got)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.slow
def test_cached_logits_equal_each_row_alone(scan):
  """Prefill of left-padded rows, then one cached step: each row's logits equal the full
  forward pass of that row alone (per-row positions, padding masked)."""
  params, cfg = _gpt(scan)
  ids, pad = gen.left_pad(PROMPTS)
  total = ids.shape[1] + 1
  cache = gen.init_cache(cfg, len(PROMPTS), total)
  key_mask = np.arange(total)[None, :] >= pad[:, None]
  positions = np.maximum(np.arange(ids.shape[1])[None, :] - pad[:, None], 0)
  logits, cache = gen.decode_step(params, cfg, cache, jnp.asarray(ids), jnp.asarray(positions),
                                  jnp.asarray(key_mask))
  nxt = np.array([[7], [8], [9]], np.int32)
  lengths = np.array([len(p) for p in PROMPTS])
  step, _ = gen.decode_step(params, cfg, cache, jnp.asarray(nxt), jnp.asarray(lengths[:, None]),
                            jnp.asarray(key_mask))
  model = build_model(cfg)
  for b, p in enumerate(PROMPTS):
    full = np.asarray(model.apply({"params": params}, jnp.asarray([p + [int(nxt[b, 0])]])))[0]
    assert np.abs(np.asarray(logits[b, pad[b]:]) - full[:-1]).max() <= 1e-5
    assert np.abs(np.asarray(step[b, 0]) - full[-1]).max() <= 1e-5


# ----------------------------------------------------------------------- vs transformers


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
  """Our model exported to a `transformers` GPT2LMHeadModel (the same weights)."""
  tmp = tmp_path_factory.mktemp("gpt2")
  params, cfg = _gpt(True)
  hf.export_hf(params, cfg, tmp)
  ref = transformers.GPT2LMHeadModel.from_pretrained(str(tmp)).eval()
  return ref, params, cfg


def _hf_generate(ref, prompt, steps, stop, **kwargs):
  # No stop token: an eos id outside the vocabulary never fires.
  eos = list(stop) or [ref.config.vocab_size + 1]
  with torch.no_grad():
    out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                         dtype=torch.long),
                       max_new_tokens=steps, eos_token_id=eos, pad_token_id=eos[0],
                       do_sample=False, **kwargs)
  new = out[0, len(prompt):].tolist()
  for i, token in enumerate(new):
    if token in eos:
      return new[:i + 1]
  return new


STOP = [31]  # reached after a few tokens by greedy and by some beams of these prompts


@pytest.mark.parametrize("kwargs", [
    {},
    {"repetition_penalty": 1.3},
    {"no_repeat_ngram_size": 2},
], ids=["plain", "repetition_penalty", "no_repeat_ngram"])
def test_greedy_equals_transformers(gpt2, kwargs):
  ref, params, cfg = gpt2
  steps = 12
  got = gen.generate(params, cfg, PROMPTS, max_new_tokens=steps, stop_tokens=STOP, **kwargs)
  expected = [_hf_generate(ref, p, steps, STOP, **kwargs) for p in PROMPTS]
  assert got == expected


def test_greedy_stops_early_and_differs_from_beam_search(gpt2):
  """The transformers comparisons below are not vacuous: stops fire, beams differ."""
  _, params, cfg = gpt2
  greedy = gen.generate(params, cfg, PROMPTS, max_new_tokens=10, stop_tokens=STOP)
  assert any(len(r) < 10 for r in greedy) and any(len(r) == 10 for r in greedy)
  beams = {lp: gen.generate(params, cfg, PROMPTS, max_new_tokens=10, num_beams=3,
                            stop_tokens=STOP, length_penalty=lp) for lp in (1.0, 0.6)}
  assert beams[1.0] != greedy and beams[1.0] != beams[0.6]


@pytest.mark.parametrize("kwargs", [
    {"length_penalty": 1.0},
    {"length_penalty": 0.6},
    {"length_penalty": 1.0, "early_stopping": True},
    {"length_penalty": 2.0, "early_stopping": "never"},
    {"length_penalty": 0.6, "stop": [4, 14]},
    {"length_penalty": 1.0, "stop": []},
    {"length_penalty": 1.0, "no_repeat_ngram_size": 2, "repetition_penalty": 1.2},
], ids=["lp1", "lp0.6", "early", "never-lp2", "two-stops", "no-stop", "ngram-reppen"])
def test_beam_search_equals_transformers(gpt2, kwargs):
  ref, params, cfg = gpt2
  steps = 10
  kwargs = dict(kwargs)
  stop = kwargs.pop("stop", STOP)
  got = gen.generate(params, cfg, PROMPTS, max_new_tokens=steps, num_beams=3,
                     stop_tokens=stop, **kwargs)
  expected = [_hf_generate(ref, p, steps, stop, num_beams=3, **kwargs) for p in PROMPTS]
  assert got == expected


# ----------------------------------------------------------------------- sampling


@pytest.mark.slow
def test_sampling_is_seeded_and_top_k_1_is_greedy():
  params, cfg = _gpt(True)

  def sample(seed, **kw):
    return gen.generate(params, cfg, PROMPTS, max_new_tokens=8, do_sample=True, seed=seed, **kw)

  assert sample(3) == sample(3)
  assert sample(3, temperature=2.0) != sample(4, temperature=2.0)
  greedy = gen.generate(params, cfg, PROMPTS, max_new_tokens=8)
  assert sample(5, top_k=1) == greedy
  assert sample(6, top_p=1e-6) == greedy


def test_stop_tokens_end_rows_separately():
  params, cfg = _gpt(True)
  free = gen.generate(params, cfg, PROMPTS, max_new_tokens=8)
  stop = free[1][1]
  got = gen.generate(params, cfg, PROMPTS, max_new_tokens=8, stop_tokens=[stop])
  for row, full in zip(got, free):
    cut = full.index(stop) + 1 if stop in full else len(full)
    assert row == full[:cut]


def test_top_k_and_top_p_filters_keep_only_allowed_tokens():
  rng = np.random.RandomState(0)
  vocab = 37
  scores = (rng.standard_normal((64, vocab)) * rng.uniform(0.1, 5, (64, 1))).astype(np.float32)
  scores[0, :4] = scores[0, 4]  # ties with the k-th score are kept (as transformers)
  for k in (1, 2, 5, 36, 37, 50):
    kept = np.isfinite(np.asarray(gen.filter_top_k(jnp.asarray(scores), k)))
    for row, keep in zip(scores, kept):
      kth = np.sort(row)[::-1][min(k, vocab) - 1]
      np.testing.assert_array_equal(keep, row >= kth)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  for p in (1e-6, 0.1, 0.5, 0.9, 0.99, 1.0):
    kept = np.isfinite(np.asarray(gen.filter_top_p(jnp.asarray(scores), p)))
    for prob, keep in zip(probs, kept):
      # The kept set is the smallest most-likely prefix whose mass reaches p.
      order = np.argsort(-prob, kind="stable")
      n = keep.sum()
      assert keep[order[0]]
      # (as a set of probabilities: which of several tied tokens stays is arbitrary)
      np.testing.assert_array_equal(np.sort(prob[keep]), np.sort(prob[order[:n]]))
      assert prob[keep].sum() >= p - 1e-5
      assert n == 1 or prob[order[:n - 1]].sum() < p + 1e-5


# ----------------------------------------------------------------------- fill-mask

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "ran", "to", "house", "big", "small",
         "red", "blue", "and", "is", "was", "in", "it", "he", "she", "they", "we", ".", ",",
         "##s", "##ed", "##ing", "bird", "tree"]


@pytest.mark.slow
def test_fill_mask_equals_transformers_pipeline(tmp_path):
  vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
  ref = hf_models.bert(tmp_path, cls=transformers.BertForMaskedLM, vocab_size=len(vocab))
  with torch.no_grad():  # sharper predictions than the noise-perturbed init
    ref.bert.embeddings.word_embeddings.weight.mul_(10.0)
  ref.save_pretrained(tmp_path)
  (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
  params, cfg, _ = hf.import_hf(tmp_path)
  tokenizer = WordPiece.from_vocab(tmp_path / "vocab.txt")
  pipe = transformers.pipeline("fill-mask", model=ref,
                               tokenizer=transformers.BertTokenizer.from_pretrained(
                                   str(tmp_path)), device="cpu")
  for text in ["The [MASK] sat on the mat.", "she ran to the big [MASK] house"]:
    ours = gen.fill_mask(params, cfg, tokenizer, text, top_k=5)
    theirs = pipe(text, top_k=5)
    assert [t for t, _ in ours] == [vocab[r["token"]] for r in theirs]
    np.testing.assert_allclose([p for _, p in ours], [r["score"] for r in theirs], atol=1e-5)
  two = gen.fill_mask(params, cfg, tokenizer, "the [MASK] sat on the [MASK] .", top_k=3)
  theirs = pipe("the [MASK] sat on the [MASK] .", top_k=3)
  assert [[t for t, _ in row] for row in two] == [[vocab[r["token"]] for r in row]
                                                   for row in theirs]


@pytest.mark.slow
def test_generate_and_fill_mask_commands(tmp_path, capsys):
  """`bertjax generate` end to end: a GPT params checkpoint with a GPT-style SentencePiece
  tokenizer (greedy == beam 1, sampling seeded), and a BERT one for fill-mask."""
  import itertools
  from bertjax import cli
  from bertjax.checkpoints import params as checkpoint
  from bertjax.data import wikipedia
  from bertjax.data.sentences import split_sentences
  from bertjax.data.sentencepiece_training import train_sentencepiece
  from bertjax.models import jit_init
  sentences = [s for a in itertools.islice(wikipedia.read_dump(wikipedia.EMBEDDED_DUMP), 5)
               for p in a.paragraphs for s in split_sentences(p)]
  for style, family in (("gpt", "gpt"), ("bert", "bert")):
    spm_dir = train_sentencepiece(sentences, tmp_path / f"spm_{style}", vocab_size=600,
                                  model_type="bpe", style=style, lowercase=False)
    cfg = ModelConfig(family=family, vocab_size=600, hidden_size=32, num_layers=2,
                      num_heads=2, mlp_dim=64, max_positions=64,
                      **({"norm_position": "pre", "type_vocab_size": 0,
                          "activation": "gelu_tanh"} if family == "gpt" else {}))
    params = jit_init(build_model(cfg))(jax.random.key(0))
    checkpoint.save_params(tmp_path / family, params, cfg)
    import shutil
    shutil.copytree(spm_dir, tmp_path / family / "tokenizer")
  base = ["generate", "--params", str(tmp_path / "gpt"), "--prompt", "The history of",
          "--prompt", "In 1850 the", "--max-new-tokens", "6"]
  assert cli.main(base) == 0
  greedy = capsys.readouterr().out.splitlines()
  assert len(greedy) == 2 and greedy[0].startswith("The history of")
  assert cli.main(base + ["--num-beams", "1"]) == 0
  assert capsys.readouterr().out.splitlines() == greedy
  assert cli.main(base + ["--sample", "--top-p", "0.9", "--seed", "3"]) == 0
  first = capsys.readouterr().out
  assert cli.main(base + ["--sample", "--top-p", "0.9", "--seed", "3"]) == 0
  assert capsys.readouterr().out == first
  assert cli.main(["generate", "--params", str(tmp_path / "bert"), "--prompt",
                   "The [MASK] sat on the mat.", "--top-k", "3"]) == 0
  lines = capsys.readouterr().out.splitlines()
  probs = [float(line.split()[0]) for line in lines[1:]]
  assert len(probs) == 3 and probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1


def test_printed_continuation_keeps_the_space_after_the_prompt(tmp_path):
  """`bertjax generate` prints prompt + continuation_text: the new ids keep the space before
  them, decoded alone (a GPT-style model has no dummy prefix, so SentencePiece drops no "▁")
  or after the prompt (a model with one, where decoding them alone would glue "the" to "of")."""
  import itertools
  from bertjax.data import wikipedia
  from bertjax.data.tokenizers import load_tokenizer
  from bertjax.data.sentencepiece_training import train_sentencepiece
  sentences = [p for a in itertools.islice(wikipedia.read_dump(wikipedia.EMBEDDED_DUMP), 5)
               for p in a.paragraphs]
  tokenizer = load_tokenizer(train_sentencepiece(sentences, tmp_path, vocab_size=600,
                                                 model_type="unigram", style="gpt"))
  prompt = tokenizer.encode("The history of")
  full = tokenizer.encode("The history of the river Été")
  assert full[:len(prompt)] == prompt
  new = full[len(prompt):]
  assert tokenizer.decode(new) == " the river Été"
  assert gen.continuation_text(tokenizer, prompt, new) == " the river Été"
  bert_style = load_tokenizer(train_sentencepiece(sentences, tmp_path / "bert", vocab_size=600,
                                                  model_type="unigram", style="bert"))
  prompt = bert_style.encode("The history of")
  new = bert_style.encode("The history of the river")[len(prompt):]
  assert bert_style.decode(new) == "the river"
  assert gen.continuation_text(bert_style, prompt, new) == " the river"
