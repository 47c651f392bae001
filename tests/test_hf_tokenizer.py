"""Exported Hugging Face directories read text as bertjax does: AutoTokenizer gives
bertjax's ids (SentencePiece BERT and GPT, cased WordPiece), fill-mask and greedy
text-generation pipelines give `bertjax generate`'s answers, and export -> import keeps the
tokenizer."""

import json
import shutil

import hf_models  # noqa: F401  (skips without torch / transformers; quiet logging)
import jax
import numpy as np
import pytest
import tokenizers

from bertjax import cli

from bertjax.checkpoints import params as checkpoint
from bertjax.inference import generate as gen
from bertjax.data.prepare import corpus_sentences
from bertjax.data.sources import parse_sources
from bertjax.data.tokenizers import load_tokenizer, special_ids
from bertjax.data.sentencepiece_training import train_sentencepiece
from bertjax.data.wordpiece import BERT_SPECIAL_TOKENS
from bertjax.models import ModelConfig, build_model, jit_init

transformers = pytest.importorskip("transformers", reason="the hf extra provides the reference")

# Each case trains a tokenizer and a run and exports it (end to end): the full suite's tier.
pytestmark = pytest.mark.slow

# Text the corpus sample may lack: runs of spaces, leading/trailing space, tabs, accents,
# digits, non-Latin scripts, an empty string.
EXTRA = ["  two  spaces  between   words ", "Café déjà vu, naïve façade: 1,234.56 km²",
         "東京 is Tokyo; 北京 is Beijing.", "tabs\tand\u00a0no-break spaces",
         "ǅemal ÅNGSTRÖM", "",
         "In 1850 the river's mouth (ἀν-) moved 3–4 km."]


@pytest.fixture(scope="module")
def corpus():
  """(tokenizer training sentences, the test texts, every sentence of the embedded sample)."""
  sentences = list(corpus_sentences(parse_sources("embedded")))
  unusual = [s for s in sentences if any(ord(c) > 127 for c in s) or "  " in s]
  # 300 test sentences, a third of them with non-ASCII characters or runs of spaces.
  test = sentences[:200:2] + sentences[5000:5200:2] + unusual[:100] + EXTRA
  assert len(test) >= 300 and len(unusual) >= 100
  return sentences[::3], test, sentences


def _spm(tmp_path_factory, corpus, style):
  """A run's tokenizer/ as the first-use data build writes it (SentencePiece, unigram)."""
  out = tmp_path_factory.mktemp(f"spm_{style}")
  return train_sentencepiece(corpus[0], out, vocab_size={"bert": 600, "t5": 500}.get(style, 700),
                             model_type="unigram", style=style)


def _wordpiece(tmp_path_factory, corpus):
  """A cased vocab.txt dir with the casing record the dataset builder writes next to it."""
  from tokenizers import BertWordPieceTokenizer
  trainer = BertWordPieceTokenizer(lowercase=False, strip_accents=False)
  trainer.train_from_iterator(corpus[0], vocab_size=1000, min_frequency=2,
                              special_tokens=list(BERT_SPECIAL_TOKENS))
  out = tmp_path_factory.mktemp("wordpiece")
  trainer.save_model(str(out))
  (out / "bertjax_tokenizer.json").write_text(json.dumps({"type": "wordpiece",
                                                          "lowercase": False}) + "\n")
  return out


def _params(cfg, seed=0):
  params = jit_init(build_model(cfg))(jax.random.key(seed))
  rng = np.random.RandomState(seed)
  params = jax.tree.map(lambda x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape)
                        .astype(np.float32), params)
  return params


def _config(arch, vocab_size):
  if arch == "modernbert":  # exported as ModernBertForMaskedLM
    return ModelConfig(family="bert", vocab_size=vocab_size, hidden_size=32, num_layers=3,
                       num_heads=2, mlp_dim=48, max_positions=64, type_vocab_size=0,
                       norm_position="pre", layer_norm_eps=1e-5, position_embedding="rotary",
                       mlp_gated=True, attention_bias=False, mlp_bias=False, norm_bias=False,
                       head_bias=False, pooler=False, local_window=4, global_every=2,
                       first_attention_norm=False)
  if arch == "bert":
    return ModelConfig(family="bert", vocab_size=vocab_size, hidden_size=32, num_layers=2,
                       num_heads=2, mlp_dim=64, max_positions=64)
  if arch in ("t5", "bart"):
    t5 = dict(norm_position="pre", activation="relu", layer_norm_eps=1e-6,
              attention_bias=False, mlp_bias=False, norm_bias=False, initializer_range=1.0,
              activation_dropout=0.1)
    return ModelConfig(family=arch, vocab_size=vocab_size, hidden_size=32, num_layers=2,
                       num_heads=2, mlp_dim=64, max_positions=64, type_vocab_size=0,
                       **(t5 if arch == "t5" else dict(layer_norm_eps=1e-5)))
  return ModelConfig(family="gpt", vocab_size=vocab_size, hidden_size=32, num_layers=2,
                     num_heads=2, mlp_dim=64, max_positions=64, norm_position="pre",
                     type_vocab_size=0, activation="gelu_tanh", layer_norm_eps=1e-5)


@pytest.fixture(scope="module", params=["bert-spm", "bert-wordpiece-cased", "gpt-spm",
                                        "modernbert-spm", "t5-spm", "bart-spm"])
def run(request, tmp_path_factory, corpus):
  """(params dir with tokenizer/, its HF export, bertjax tokenizer, family)."""
  arch, kind = request.param.split("-", 1)
  family = arch if arch in ("gpt", "t5", "bart") else "bert"
  if kind == "spm":
    tokenizer_dir = _spm(tmp_path_factory, corpus, family)
  else:
    tokenizer_dir = _wordpiece(tmp_path_factory, corpus)
  tokenizer = load_tokenizer(tokenizer_dir)
  cfg = _config(arch, len(tokenizer))
  params = _params(cfg)
  if family == "bert":  # sharper MLM predictions than the perturbed init
    params["bert"]["word_embeddings"]["embedding"] *= 10.0
  root = tmp_path_factory.mktemp(request.param)
  checkpoint.save_params(root / "params", params, cfg)
  shutil.copytree(tokenizer_dir, root / "params" / "tokenizer")
  assert cli.main(["export", "--params", str(root / "params"), "--format", "hf", "--out",
                   str(root / "hf")]) == 0
  return root / "params", root / "hf", tokenizer, family


def _with_specials(tokenizer, family, ids):
  if family == "bert":
    return [tokenizer.token_id("[CLS]")] + ids + [tokenizer.token_id("[SEP]")]
  if family == "t5":
    return ids + [tokenizer.token_id("</s>")]
  if family == "bart":
    return [tokenizer.token_id("<s>")] + ids + [tokenizer.token_id("</s>")]
  return ids


def test_autotokenizer_ids_equal_bertjax(run, corpus):
  _, export, tokenizer, family = run
  theirs = transformers.AutoTokenizer.from_pretrained(export)
  # tokenizer.json alone too (the `tokenizers` library, other runtimes): transformers'
  # BertTokenizer builds its WordPiece pipeline from tokenizer_config.json instead.
  raw = tokenizers.Tokenizer.from_file(str(export / "tokenizer.json"))
  assert len(theirs) == len(tokenizer)
  for text in corpus[1]:
    ours = _with_specials(tokenizer, family, tokenizer.encode(text))
    assert theirs(text)["input_ids"] == ours, text
    assert raw.encode(text).ids == ours, text
  if family == "bert":
    pair = theirs("The river.", "A [MASK] city.")
    a, b = tokenizer.encode("The river."), tokenizer.encode("A")
    assert pair["token_type_ids"] == [0] * (len(a) + 2) + [1] * (len(pair["input_ids"])
                                                                  - len(a) - 2)
    assert pair["input_ids"][len(a) + 2:len(a) + 2 + len(b)] == b
  else:
    # GPT2LMHeadModel would add the embedding of token_type_ids: never produced.
    assert "token_type_ids" not in theirs("The river.")
  config = json.loads((export / "config.json").read_text())
  if family == "gpt":
    assert config["eos_token_id"] == config["bos_token_id"] == tokenizer.eot_id
    assert config["pad_token_id"] == tokenizer.pad_id
  if config["model_type"] == "modernbert":
    assert (config["pad_token_id"], config["cls_token_id"], config["sep_token_id"]) == (
        tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id)


def test_autotokenizer_decodes_as_bertjax(run, corpus):
  """transformers' decode of an export equals bertjax's decode of the same ids, special and
  unknown tokens skipped or spelled out, for every sentence of the embedded sample, and with the
  special tokens its encode adds. GPT's too: its SentencePiece model has no dummy prefix (as
  GPT-2), so a text's first word has no space to drop and a continuation's tokens decode with
  their space (transformers' text-generation pipeline decodes the new tokens alone and appends
  them to the prompt: test_greedy_text_generation_equals_bertjax)."""
  _, export, tokenizer, family = run
  theirs = transformers.AutoTokenizer.from_pretrained(export)
  unk = special_ids(tokenizer)["unk"]
  for text in corpus[2]:
    ids = tokenizer.encode(text)
    with_specials = _with_specials(tokenizer, family, ids)
    for skip in (True, False):
      assert theirs.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
          ids, skip_special_tokens=skip), text
    if unk not in ids:  # transformers' WordPiece drops [UNK] there, keeping it without them
      assert theirs.decode(with_specials, skip_special_tokens=True) == tokenizer.decode(
          ids), text


def test_whole_sample_differs_only_where_scores_tie(run, corpus):
  """Every sentence of the embedded sample: the same ids, except where a SentencePiece unigram
  model has two segmentations of exactly equal score ("000" as "00" "0" or as "0" "00"):
  SentencePiece sums piece scores in float32 and keeps whichever rounding favours, `tokenizers`
  sums in float64, where they tie, and keeps the first. Vocabularies as small as these tie on
  a few sentences in ten thousand; WordPiece has no scores and never differs."""
  _, export, tokenizer, _ = run
  theirs = transformers.AutoTokenizer.from_pretrained(export)
  texts = corpus[2]
  encoded = theirs(texts, add_special_tokens=False)["input_ids"]
  differ = [(ours, ids) for ours, ids in zip(tokenizer.encode_batch(texts), encoded)
            if ours != ids]
  if hasattr(tokenizer, "vocab"):
    assert not differ
    return
  import sentencepiece
  score = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer.path)).get_score
  for ours, ids in differ:
    assert sum(score(i) for i in ours) == pytest.approx(sum(score(i) for i in ids), rel=1e-9)
  assert len(differ) <= len(texts) // 1000


def test_cased_wordpiece_stays_cased(run):
  params_dir, export, tokenizer, family = run
  if family != "bert" or not hasattr(tokenizer, "vocab"):
    pytest.skip("cased WordPiece only")
  # What `bertjax generate` loads: casing from bertjax_tokenizer.json, not the default.
  assert load_tokenizer(params_dir / "tokenizer").lowercase is False
  config = json.loads((export / "tokenizer_config.json").read_text())
  assert config["do_lower_case"] is False
  theirs = transformers.AutoTokenizer.from_pretrained(export)
  assert theirs.tokenize("Paris") != theirs.tokenize("paris")


def test_fill_mask_pipeline_equals_bertjax(run):
  params_dir, export, tokenizer, family = run
  if family != "bert":
    pytest.skip("BERT only")
  params, cfg = checkpoint.load_params(params_dir)
  model = transformers.AutoModelForMaskedLM.from_pretrained(export)
  pipe = transformers.pipeline("fill-mask", model=model, tokenizer=str(export), device="cpu")
  names = (pipe.tokenizer.convert_ids_to_tokens if hasattr(tokenizer, "vocab")
           else lambda i: pipe.tokenizer.decode([i]))
  for text in ["The [MASK] of the river.", "In 1850 the city had a population of [MASK].",
               "Café owners in Zürich [MASK] the new law."]:
    ours = gen.fill_mask(params, cfg, tokenizer, text, top_k=5)
    theirs = pipe(text, top_k=5)
    assert [t for t, _ in ours] == [names(r["token"]) for r in theirs], text
    np.testing.assert_allclose([p for _, p in ours], [r["score"] for r in theirs], atol=1e-4)


def _swap_rows(params, a, b):
  """Swaps two tokens' tied embedding rows: the model then predicts `b` where it predicted
  `a` (and vice versa)."""
  wte = np.array(params["wte"]["embedding"])
  wte[[a, b]] = wte[[b, a]]
  params["wte"]["embedding"] = wte
  return params


def test_greedy_text_generation_equals_bertjax(run, tmp_path, capsys):
  params_dir, _, tokenizer, family = run
  if family != "gpt":
    pytest.skip("GPT only")
  prompts = ["The history of", "In 1850 the"]
  params, cfg = jax.device_get(checkpoint.load_params(params_dir))
  # Random weights pick byte pieces often; a run of them that is not valid UTF-8 decodes
  # differently (transformers' ByteFallback decoder turns the whole run into U+FFFD,
  # SentencePiece only the invalid bytes), so they are made unlikely: zero embedding rows.
  wte = np.array(params["wte"]["embedding"])
  wte[3:259] = 0.0
  params["wte"]["embedding"] = wte
  # Make greedy decoding of the first prompt end at <|endoftext|> (at the first new token not
  # seen before), so the stop (config.json's eos_token_id in transformers) is compared too.
  prompt_ids = tokenizer.encode(prompts[0])
  new = gen.generate(params, cfg, [prompt_ids], max_new_tokens=8)[0]
  assert tokenizer.eot_id not in new
  k = next(k for k in range(1, 8) if new[k] not in prompt_ids + new[:k])
  params = _swap_rows(params, new[k], tokenizer.eot_id)
  checkpoint.save_params(tmp_path / "params", params, cfg)
  shutil.copytree(params_dir / "tokenizer", tmp_path / "params" / "tokenizer")
  assert cli.main(["export", "--params", str(tmp_path / "params"), "--out",
                   str(tmp_path / "hf")]) == 0
  capsys.readouterr()
  assert cli.main(["generate", "--params", str(tmp_path / "params"), "--max-new-tokens", "12",
                   *[a for p in prompts for a in ("--prompt", p)]]) == 0
  ours = capsys.readouterr().out.splitlines()
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
  pipe = transformers.pipeline("text-generation", model=model, tokenizer=str(tmp_path / "hf"),
                               device="cpu")
  theirs = [pipe(p, do_sample=False, max_new_tokens=12)[0]["generated_text"] for p in prompts]
  assert ours == theirs
  assert "\ufffd" not in "".join(ours)
  # The space between prompt and continuation is kept ("The history of the", not "...ofthe").
  assert ours[1].startswith(prompts[1] + " ")
  stopped = gen.generate(params, cfg, [prompt_ids], max_new_tokens=12,
                         stop_tokens=[tokenizer.eot_id])[0]
  assert stopped == new[:k] + [tokenizer.eot_id]


def test_export_import_round_trip_keeps_tokenizer(run, tmp_path, corpus):
  params_dir, export, tokenizer, family = run
  assert cli.main(["import", str(export), "--out", str(tmp_path / "back")]) == 0
  back = load_tokenizer(tmp_path / "back" / "tokenizer")
  assert back.lowercase == tokenizer.lowercase
  assert cli.main(["export", "--params", str(params_dir), "--format", "params", "--out",
                   str(tmp_path / "copy")]) == 0
  for directory in (tmp_path / "back" / "tokenizer", tmp_path / "copy" / "tokenizer"):
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    for text in corpus[1][::10]:
      ours = tokenizer.encode(text)
      assert back.encode(text) == ours
      assert theirs(text)["input_ids"] == _with_specials(tokenizer, family, ours), text


def test_export_without_tokenizer_says_so(tmp_path, capsys):
  """Parameters with no tokenizer/ export weights only, and say so; a GPT's config.json then
  keeps GPT-2's convention (the last id is <|endoftext|>)."""
  cfg = _config("gpt", 300)
  checkpoint.save_params(tmp_path / "params", _params(cfg), cfg)
  assert cli.main(["export", "--params", str(tmp_path / "params"), "--out",
                   str(tmp_path / "hf")]) == 0
  assert "has no tokenizer/: wrote weights only" in capsys.readouterr().out
  assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json",
                                                                 "model.safetensors"]
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert config["bos_token_id"] == config["eos_token_id"] == 299
