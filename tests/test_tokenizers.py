"""SentencePiece training and loading (bertjax.data.tokenizers): the special-token layouts of
the BERT and GPT styles, round trips, byte fallback, determinism, `load_tokenizer` dispatch
and the errors, on sentences of the embedded Wikipedia sample."""

from __future__ import annotations

import itertools
import json
import pickle
import unicodedata

import pytest

from bertjax.data import wikipedia
from bertjax.data.errors import CorpusError
from bertjax.data.sentences import split_sentences
from bertjax.data.sentencepiece_training import train_sentencepiece
from bertjax.data.tokenizers import (EOT_TOKEN, SentencePieceTokenizer, load_tokenizer,
                                     special_ids)
from bertjax.data.wordpiece import BERT_SPECIAL_TOKENS, WordPiece

# Text outside a small English vocabulary: CJK, emoji, accents, tabs, runs of spaces, newlines.
ODD_TEXTS = ["東京 is Tokyo; 北京 is Beijing.", "smile 😀🎉 ok", "Café déjà vu — naïve façade",
             "tabs\tand  two  spaces", "  leading and trailing  ", "line one\nline two\n",
             "ǅemal ÅNGSTRÖM", "", "Ω≈ç√∫"]

# (style, model_type, lowercase) of the models trained once for the module.
MODELS = [("bert", "unigram", True), ("bert", "bpe", False), ("gpt", "bpe", False),
          ("gpt", "unigram", True)]
MODEL_IDS = ["bert-unigram-uncased", "bert-bpe-cased", "gpt-bpe-cased", "gpt-unigram-uncased"]


@pytest.fixture(scope="module")
def sentences():
  out = []
  for article in itertools.islice(wikipedia.read_dump(wikipedia.EMBEDDED_DUMP), 20):
    for paragraph in article.paragraphs:
      out += split_sentences(paragraph)
  assert len(out) > 3000
  return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, sentences):
  """Trains each of MODELS on first use; {(style, model_type, lowercase): directory}."""
  cache = {}

  def get(style, model_type, lowercase):
    key = (style, model_type, lowercase)
    if key not in cache:
      out = tmp_path_factory.mktemp(f"{style}-{model_type}-{int(lowercase)}")
      cache[key] = train_sentencepiece(sentences, out, vocab_size=1000, model_type=model_type,
                                       style=style, lowercase=lowercase)
    return cache[key]

  return get


@pytest.fixture(params=MODELS, ids=MODEL_IDS)
def model(request, model_dirs):
  style, model_type, lowercase = request.param
  directory = model_dirs(style, model_type, lowercase)
  return directory, SentencePieceTokenizer.from_dir(directory), request.param


@pytest.mark.parametrize("model_type,lowercase", [("unigram", True), ("bpe", False)])
def test_bert_style_special_ids(model_dirs, model_type, lowercase):
  directory = model_dirs("bert", model_type, lowercase)
  tok = SentencePieceTokenizer.from_dir(directory, require="bert")
  assert [tok.token_id(t) for t in BERT_SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
  assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id, tok.eot_id) == (
      0, 1, 2, 3, 4, None)
  assert special_ids(tok) == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "eot": None,
                             "bos": None, "eos": None}
  assert tok.style == "bert" and tok.lowercase == lowercase and len(tok) == 1000
  # No BOS/EOS or other specials are added by encode; control symbols never come from text.
  ids = tok.encode("The war ended. [CLS] [MASK]")
  assert not {0, 2, 3, 4} & set(ids)
  config = json.loads((directory / "bertjax_tokenizer.json").read_text())
  assert config["type"] == "sentencepiece" and config["style"] == "bert"
  assert config["lowercase"] == lowercase and config["model_type"] == model_type
  assert config["special_tokens"] == {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]",
                                      "sep": "[SEP]", "mask": "[MASK]"}
  assert config["special_ids"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
  vocab = (directory / "spm.vocab").read_text(encoding="utf-8").splitlines()
  assert len(vocab) == 1000 and [v.split("\t")[0] for v in vocab[:5]] == list(BERT_SPECIAL_TOKENS)


def test_t5_style_special_ids_and_sentinels(model_dirs):
  """T5's layout: <pad> </s> <unk> first, then the pieces, then the 100 sentinels with
  <extra_id_0> last; sentinels and </s> never come from text, and decode skips them."""
  tok = load_tokenizer(model_dirs("t5", "unigram", False), require="t5")
  assert len(tok) == 1100 and tok.style == "t5"
  assert special_ids(tok) == {"pad": 0, "unk": 2, "cls": None, "sep": None, "mask": None,
                              "eot": None, "bos": None, "eos": 1}
  assert tok.first_sentinel == 1099 == tok.token_id("<extra_id_0>")
  assert [tok.token_id(f"<extra_id_{i}>") for i in (1, 99)] == [1098, 1000]
  ids = tok.encode("The war ended. <extra_id_0> </s>")
  assert not {0, 1} & set(ids) and max(ids) < 1000
  assert tok.decode(tok.encode("The war") + [1099, 1] + tok.encode("ended.")) == (
      "The war ended.")
  with pytest.raises(CorpusError, match="sentinels"):
    load_tokenizer(model_dirs("bert", "unigram", True), require="t5")


def test_bart_style_special_ids(model_dirs):
  """fairseq's layout: <s> <pad> </s> <unk>, the byte pieces, the pieces, <mask> last."""
  tok = load_tokenizer(model_dirs("bart", "bpe", False), require="bart")
  assert len(tok) == 1001 and tok.style == "bart" and tok.first_sentinel is None
  assert special_ids(tok) == {"pad": 1, "unk": 3, "cls": None, "sep": None, "mask": 1000,
                              "eot": None, "bos": 0, "eos": 2}
  text = "tabs\tand  two  spaces, Café 東京"
  assert tok.decode(tok.encode(text)) == text  # byte fallback, no normalisation


@pytest.mark.parametrize("model_type,lowercase", [("bpe", False), ("unigram", True)])
def test_gpt_style_special_ids(model_dirs, model_type, lowercase):
  tok = SentencePieceTokenizer.from_dir(model_dirs("gpt", model_type, lowercase), require="gpt")
  assert (tok.unk_id, tok.eot_id, tok.pad_id) == (0, 1, 2)
  assert tok.token_id(EOT_TOKEN) == 1 and tok.token_id("<pad>") == 2
  assert (tok.cls_id, tok.sep_id, tok.mask_id) == (None, None, None)
  assert special_ids(tok) == {"pad": 2, "unk": 0, "cls": None, "sep": None, "mask": None,
                              "eot": 1, "bos": None, "eos": None}
  assert [tok.token_id(f"<0x{b:02X}>") for b in (0, 0x41, 0xFF)] == [3, 3 + 0x41, 258]
  assert tok.style == "gpt" and tok.lowercase == lowercase
  # A control symbol: text spelling it is just text (documents are joined by id, not string).
  assert tok.eot_id not in tok.encode(f"a {EOT_TOKEN} b")


def _casefolded(text: str) -> str:
  """What SentencePiece's case-folding rules make of case: NFKC again after casefold, since
  casefold can leave decomposed characters (final sigma, Greek accents)."""
  return unicodedata.normalize("NFKC", text.casefold())


@pytest.mark.parametrize("model_type,lowercase", [("unigram", True), ("bpe", False)])
def test_bert_style_round_trip(model_dirs, sentences, model_type, lowercase):
  tok = load_tokenizer(model_dirs("bert", model_type, lowercase))
  with_unk = 0
  for sentence in sentences + ODD_TEXTS:
    ids = tok.encode(sentence)
    if tok.unk_id in ids:  # characters outside character_coverage (as in BERT)
      with_unk += 1
      continue
    # nmt_nfkc: NFKC, whitespace runs squeezed, ends trimmed.
    expected = " ".join(unicodedata.normalize("NFKC", sentence).split())
    assert tok.decode(ids) == (_casefolded(expected) if lowercase else expected), sentence
  assert with_unk < 0.1 * len(sentences)
  assert tok.unk_id in tok.encode("smile 😀")


@pytest.mark.parametrize("model_type,lowercase", [("bpe", False), ("unigram", True)])
def test_gpt_style_round_trip_is_exact_with_byte_fallback(model_dirs, sentences, model_type,
                                                          lowercase):
  tok = load_tokenizer(model_dirs("gpt", model_type, lowercase))
  for text in sentences + ODD_TEXTS:
    ids = tok.encode(text)
    assert tok.unk_id not in ids, text
    # Cased: byte-exact, whitespace and all. Uncased (nfkc_cf): NFKC + case folding only.
    expected = _casefolded(unicodedata.normalize("NFKC", text)) if lowercase else text
    assert tok.decode(ids) == expected, text
  # Unseen characters are spelled as their UTF-8 bytes.
  assert tok.tokens("😀")[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
  assert tok.decode(tok.encode("😀 東京")) == "😀 東京"


def test_lowercasing_is_in_the_model(model_dirs):
  uncased = load_tokenizer(model_dirs("bert", "unigram", True))
  cased = load_tokenizer(model_dirs("bert", "bpe", False), lowercase=True)  # ignored for spm
  assert uncased.lowercase and not cased.lowercase
  assert uncased.encode("The WAR Ended") == uncased.encode("the war ended")
  assert cased.encode("The WAR Ended") != cased.encode("the war ended")


def test_encode_batch_equals_encode(model, sentences):
  _, tok, _ = model
  texts = sentences[:400] + ODD_TEXTS
  assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
  assert tok.encode_batch([]) == []


def test_is_continuation_marks_word_pieces(model):
  _, tok, _ = model
  # A GPT-style model has no dummy prefix (as GPT-2): a text's first word has no word-start
  # piece, so the word is given its space.
  assert tok.dummy_prefix == (tok.style != "gpt")
  word = "unquestionably" if tok.dummy_prefix else " unquestionably"
  ids = tok.encode(word)
  assert len(ids) > 1, tok.tokens(word)
  assert [tok.is_continuation(i) for i in ids] == [False] + [True] * (len(ids) - 1)
  two_words = tok.encode(("" if tok.dummy_prefix else " ") + "anarchists unquestionably")
  starts = [i for i in two_words if not tok.is_continuation(i)]
  assert len(starts) == 2
  for special in filter(lambda i: i is not None, special_ids(tok).values()):
    assert not tok.is_continuation(special)
  if tok.style == "gpt":
    assert not tok.is_continuation(tok.token_id("<0x41>"))
  with pytest.raises(IndexError):
    tok.is_continuation(len(tok))


def test_token_id_and_pickle(model):
  _, tok, _ = model
  with pytest.raises(KeyError):
    tok.token_id("no-such-piece-anywhere")
  assert tok.token_id(tok.tokens("the")[0]) == tok.encode("the")[0]
  copy = pickle.loads(pickle.dumps(tok))
  assert copy.encode("The war ended in 1945.") == tok.encode("The war ended in 1945.")


@pytest.mark.parametrize("style,model_type", [("bert", "unigram"), ("gpt", "bpe")])
def test_training_is_deterministic(tmp_path, sentences, style, model_type):
  texts = sentences[:1200]
  dirs = [train_sentencepiece(texts, tmp_path / str(i), vocab_size=600, model_type=model_type,
                              style=style) for i in range(2)]
  for name in ("spm.model", "spm.vocab", "bertjax_tokenizer.json"):
    assert (dirs[0] / name).read_bytes() == (dirs[1] / name).read_bytes(), name


def test_sampling_beyond_max_sentences_is_reproducible(tmp_path, sentences):
  def train(name, seed):
    out = train_sentencepiece(sentences, tmp_path / name, vocab_size=500, model_type="bpe",
                              style="bert", max_sentences=800, seed=seed)
    return (out / "spm.model").read_bytes(), json.loads((out / "bertjax_tokenizer.json")
                                                        .read_text())["training"]

  first, info = train("a", 0)
  assert info["sentences_seen"] == len(sentences) and info["sentences_used"] == 800
  assert train("b", 0)[0] == first
  assert train("c", 1)[0] != first


def test_load_tokenizer_dispatch(tmp_path, model_dirs):
  tokens = list(BERT_SPECIAL_TOKENS) + ["the", "war", "##s", "end", "##ed", "."]
  vocab_dir = tmp_path / "wp"
  vocab_dir.mkdir()
  (vocab_dir / "vocab.txt").write_text("\n".join(tokens) + "\n")
  for path in (vocab_dir, vocab_dir / "vocab.txt"):
    tok = load_tokenizer(path)
    assert isinstance(tok, WordPiece) and tok.lowercase
    assert special_ids(tok) == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "eot": None,
                             "bos": None, "eos": None}
    assert tok.encode("The wars ended.") == [5, 6, 7, 8, 9, 10]
  assert not load_tokenizer(vocab_dir, lowercase=False).lowercase

  spm_dir = model_dirs("bert", "bpe", False)
  for path in (spm_dir, spm_dir / "spm.model"):
    tok = load_tokenizer(path, require="bert")
    assert isinstance(tok, SentencePieceTokenizer) and tok.style == "bert"
  assert load_tokenizer(model_dirs("gpt", "bpe", False), require="gpt").eot_id == 1


def test_load_tokenizer_errors(tmp_path, model_dirs):
  with pytest.raises(CorpusError, match="no such tokenizer"):
    load_tokenizer(tmp_path / "missing")
  with pytest.raises(CorpusError, match="no tokenizer in this directory"):
    load_tokenizer(tmp_path)
  (tmp_path / "tokenizer.bin").write_text("{}")
  with pytest.raises(CorpusError, match="not a known tokenizer file.*vocab.txt.*tokenizer.json"):
    load_tokenizer(tmp_path / "tokenizer.bin")
  # A Hugging Face tokenizer.json the tokenizers library cannot read: one line naming it.
  (tmp_path / "tokenizer.json").write_text("{}")
  with pytest.raises(CorpusError, match=r"tokenizer.json: not a tokenizer.json the tokenizers "
                     r"library reads \(Model missing") as raised:
    load_tokenizer(tmp_path / "tokenizer.json")
  assert "\n" not in str(raised.value)
  both = tmp_path / "both"
  both.mkdir()
  (both / "vocab.txt").write_text("\n".join(BERT_SPECIAL_TOKENS))
  (both / "spm.model").write_bytes((model_dirs("bert", "bpe", False) / "spm.model").read_bytes())
  with pytest.raises(CorpusError, match="ambiguous"):
    load_tokenizer(both)
  with pytest.raises(CorpusError, match="no <\\|endoftext\\|> token"):
    load_tokenizer(both / "vocab.txt", require="gpt")
  (tmp_path / "junk.model").write_bytes(b"not a protobuf at all")
  with pytest.raises(CorpusError, match="not a SentencePiece model"):
    load_tokenizer(tmp_path / "junk.model")
  with pytest.raises(CorpusError, match=r"lacks the special token\(s\) \[PAD\], \[UNK\], "
                                        r"\[CLS\], \[SEP\], \[MASK\] that BERT needs"):
    SentencePieceTokenizer.from_dir(model_dirs("gpt", "bpe", False), require="bert")
  with pytest.raises(CorpusError, match="lacks the <\\|endoftext\\|> token"):
    SentencePieceTokenizer.from_dir(model_dirs("bert", "bpe", False), require="gpt")
  with pytest.raises(CorpusError, match="no spm.model"):
    SentencePieceTokenizer.from_dir(tmp_path)


def test_training_errors(tmp_path, sentences):
  def train(texts=sentences[:300], **kw):
    args = dict(vocab_size=500, model_type="bpe", style="bert") | kw
    return train_sentencepiece(texts, tmp_path / "out", **args)

  with pytest.raises(ValueError, match="vocab_size 5 is too small: bert style reserves 5"):
    train(vocab_size=5)
  with pytest.raises(ValueError, match="vocab_size 200 is too small: gpt style reserves 259 ids"):
    train(vocab_size=200, style="gpt")
  # Past the reserved ids but short of the alphabet: SentencePiece's check, reworded.
  with pytest.raises(ValueError, match=r"vocab_size 20 is too small.*need at least \d+; raise "
                                       "vocab_size or lower character_coverage"):
    train(vocab_size=20)
  with pytest.raises(ValueError, match=r"vocab_size 50000 is too large for this corpus "
                                       r"\(300 lines\).*use vocab_size <= \d+"):
    train(vocab_size=50_000)
  with pytest.raises(ValueError, match="model_type 'char': expected one of unigram, bpe"):
    train(model_type="char")
  with pytest.raises(ValueError, match="style 'xlnet': expected one of bert, gpt, t5, bart"):
    train(style="xlnet")
  for empty in ([], ["", "  \n\t", "\n"]):
    with pytest.raises(CorpusError, match="no sentences"):
      train(texts=empty)
  with pytest.raises(TypeError, match="not one string"):
    train(texts="a single string")
  assert not (tmp_path / "out").exists()  # nothing half-written on failure


def test_wordpiece_casing_comes_from_the_vocab_directory(tmp_path):
  """A cased vocab.txt is not silently lower-cased: `load_tokenizer` (what `bertjax generate`
  uses) reads the casing the dataset builder or a Hugging Face directory recorded."""
  (tmp_path / "vocab.txt").write_text("\n".join([*BERT_SPECIAL_TOKENS, "Paris", "paris"]) + "\n")
  assert load_tokenizer(tmp_path).lowercase is True  # nothing recorded: bert-base-uncased
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
  assert load_tokenizer(tmp_path).lowercase is False
  (tmp_path / "bertjax_tokenizer.json").write_text(json.dumps({"type": "wordpiece",
                                                              "lowercase": False}))
  cased = load_tokenizer(tmp_path / "vocab.txt")
  assert cased.lowercase is False and cased.encode("Paris") == [5]
  assert load_tokenizer(tmp_path, lowercase=True).encode("Paris") == [6]  # explicit wins


def test_first_use_build_casing(tmp_path, model_dirs):
  """data.lowercase of a build on first use: "" keeps each tokenizer's default, true / false
  choose for a trained SentencePiece or a vocab.txt, and contradict a given SentencePiece
  model (its casing was fixed when it was trained) with an error."""
  from bertjax.data.prepare import build_lowercase
  assert build_lowercase("", "") is False and build_lowercase("true", "") is True
  (tmp_path / "vocab.txt").write_text("\n".join(BERT_SPECIAL_TOKENS) + "\n")
  assert build_lowercase("", str(tmp_path / "vocab.txt")) is True  # bert-base-uncased
  assert build_lowercase("false", str(tmp_path)) is False
  (tmp_path / "bertjax_tokenizer.json").write_text(json.dumps({"lowercase": False}))
  assert build_lowercase("", str(tmp_path / "vocab.txt")) is False  # as recorded
  uncased = model_dirs("bert", "unigram", True)
  assert build_lowercase("", str(uncased)) is True
  assert build_lowercase("true", str(uncased / "spm.model")) is True
  with pytest.raises(ValueError, match="lower-casing SentencePiece model"):
    build_lowercase("false", str(uncased))
  with pytest.raises(ValueError, match="data.lowercase"):
    build_lowercase("maybe", "")


def test_decode_skips_or_spells_special_tokens(model, sentences):
  """decode(skip_special_tokens=True), the default, leaves control and unknown pieces out;
  False spells each out as its piece, the text's spaces kept: what transformers' decode of
  the exported tokenizer.json gives (for BERT style; GPT style's export keeps the leading
  space, docs/generation.md)."""
  from bertjax.hf import tokenizer as hf_tokenizer
  _, tok, (style, _, _) = model
  fast = hf_tokenizer.sentencepiece_fast(tok.path)
  specials = [i for i in range(len(tok)) if i in special_ids(tok).values()]
  assert len(specials) == (5 if style == "bert" else 3)
  pieces = {i: tok._sp.id_to_piece(i) for i in specials}
  for n, sentence in enumerate(sentences[:300]):
    ids = tok.encode(sentence)
    if tok.unk_id in ids:
      continue
    with_specials = list(ids)
    with_specials.insert(n % (len(ids) + 1), specials[n % len(specials)])
    with_specials.append(specials[(n + 1) % len(specials)])
    assert tok.decode(with_specials) == tok.decode(ids) == tok.decode(ids, False), sentence
    assert tok.decode(with_specials, skip_special_tokens=True) == tok.decode(ids)
    spelled = tok.decode(with_specials, skip_special_tokens=False)
    expected = fast.decode(with_specials, skip_special_tokens=False)
    assert spelled == (expected if style == "bert" else expected.removeprefix(" ")), sentence
    assert spelled.endswith(pieces[with_specials[-1]])
  first, second = tok.encode("The first document."), tok.encode("The second one.")
  if style == "bert":
    ids = [tok.cls_id, *first, tok.sep_id, *second, tok.sep_id]
    expected = "[CLS] {}[SEP] {}[SEP]"
  else:
    # No dummy prefix (as GPT-2): the second document's first word has no space before it.
    ids = [*first, tok.eot_id, *second]
    expected = "{}<|endoftext|>{}"
  plain = [tok.decode(first), tok.decode(second)]
  assert tok.decode(ids, skip_special_tokens=False) == expected.format(*plain)
  assert tok.decode(ids) == (" " if style == "bert" else "").join(plain)
  if style == "bert":  # [UNK] is special too (GPT style spells unknown characters as bytes)
    ids = tok.encode("smile 😀")
    assert tok.unk_id in ids
    assert tok.decode(ids, skip_special_tokens=False).endswith("[UNK]")
    assert "[UNK]" not in tok.decode(ids) and "\u2047" not in tok.decode(ids)
