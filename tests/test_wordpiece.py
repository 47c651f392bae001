"""WordPiece vocab.txt loading: ids equal Hugging Face's BertTokenizer (the `tokenizers`
backend of transformers 5) and BertTokenizerLegacy (the pure-Python port of
google-research/bert's tokenizer), cased and uncased, on thousands of Wikipedia sentences."""

import pytest

from bertjax.data import wikipedia
from bertjax.data.sentences import split_sentences
from bertjax.data.wordpiece import BERT_SPECIAL_TOKENS, WordPiece

transformers = pytest.importorskip("transformers", reason="the hf extra provides the reference")
from tokenizers import BertWordPieceTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def sentences():
  out = []
  for article in wikipedia.read_dump(wikipedia.EMBEDDED_DUMP):
    for paragraph in article.paragraphs:
      out += split_sentences(paragraph)
  assert len(out) > 3000
  # Every 4th sentence, plus text that exercises the basic tokenizer's corners.
  return out[::4] + ["Café déjà vu — naïve façade", "東京 is Tokyo; 北京 is Beijing.",
                     "tabs\tand\u00a0spaces\u200b and control\x07 chars", "ǅemal ÅNGSTRÖM",
                     "a" * 150, "", "   "]


@pytest.fixture(scope="module", params=[True, False], ids=["uncased", "cased"])
def vocab(request, tmp_path_factory, sentences):
  """A WordPiece vocab trained on the sample with `tokenizers` (no download needed)."""
  lowercase = request.param
  trainer = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=lowercase)
  trainer.train_from_iterator(sentences, vocab_size=3000, min_frequency=2,
                              special_tokens=list(BERT_SPECIAL_TOKENS))
  directory = tmp_path_factory.mktemp("uncased" if lowercase else "cased")
  trainer.save_model(str(directory))
  return directory / "vocab.txt", lowercase


def test_ids_equal_hugging_face_bert_tokenizers(vocab, sentences):
  path, lowercase = vocab
  ours = WordPiece.from_vocab(path, lowercase=lowercase)
  references = [
      # transformers 5 builds its BertTokenizer from a directory (its vocab_file argument
      # alone leaves an empty vocabulary).
      transformers.BertTokenizer.from_pretrained(str(path.parent), do_lower_case=lowercase),
      transformers.BertTokenizerLegacy(vocab_file=str(path), do_lower_case=lowercase)]
  got = ours.encode_batch(sentences)
  for reference in references:
    mismatches = [(s, g) for s, g in zip(sentences, got)
                  if g != reference.encode(s, add_special_tokens=False)]
    assert not mismatches, (type(reference).__name__, len(mismatches), mismatches[:3])
  assert sum(map(len, got)) > 50_000


def test_continuation_pieces_are_marked(vocab):
  path, lowercase = vocab
  wp = WordPiece.from_vocab(path, lowercase=lowercase)
  ids = wp.encode("anarchists unquestionably")
  tokens = wp.tokens("anarchists unquestionably")
  assert [wp.is_continuation(i) for i in ids] == [t.startswith("##") for t in tokens]
  assert any(t.startswith("##") for t in tokens)


def test_vocab_without_special_tokens_is_refused(tmp_path):
  path = tmp_path / "vocab.txt"
  path.write_text("[PAD]\n[UNK]\nthe\nof\n")
  with pytest.raises(wikipedia.CorpusError, match=r"vocab\.txt: vocabulary lacks the special "
                                                  r"token\(s\) \[CLS\], \[SEP\], \[MASK\]"):
    WordPiece.from_vocab(path)


def test_non_utf8_or_missing_vocab(tmp_path):
  path = tmp_path / "vocab.txt"
  path.write_bytes(b"[PAD]\n\xff\xfe\n")
  with pytest.raises(wikipedia.CorpusError, match="not UTF-8 text at byte 6"):
    WordPiece.from_vocab(path)
  with pytest.raises(wikipedia.CorpusError, match="no such vocabulary file"):
    WordPiece.from_vocab(tmp_path / "missing.txt")


def test_decode_and_tokens_equal_hugging_face_bert_tokenizer(vocab, sentences):
  """`decode` is transformers' BertTokenizer.decode (both clean-up settings, special tokens
  kept or skipped) on every sentence in BERT's [CLS] ... [SEP] layout with a special token
  inside; `tokens` is its `tokenize`."""
  path, lowercase = vocab
  ours = WordPiece.from_vocab(path, lowercase=lowercase)
  theirs = transformers.BertTokenizer.from_pretrained(str(path.parent), do_lower_case=lowercase)
  assert theirs.clean_up_tokenization_spaces is False  # transformers 5's default for BERT
  specials = [ours.token_id(t) for t in BERT_SPECIAL_TOKENS]
  for n, sentence in enumerate(sentences):
    assert ours.tokens(sentence) == theirs.tokenize(sentence), sentence
    ids = [ours.token_id("[CLS]"), *ours.encode(sentence), ours.token_id("[SEP]")]
    ids.insert(n % len(ids), specials[n % len(specials)])
    assert ours.decode(ids) == theirs.decode(ids), sentence
    for skip in (False, True):
      for clean_up in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean_up
                           ) == theirs.decode(ids, skip_special_tokens=skip,
                                              clean_up_tokenization_spaces=clean_up), sentence
  # What the comparison covered: word pieces glued, punctuation, contractions.
  text = "It's the anarchists, isn't it? Yes, they're here."
  ids = ours.encode(text)
  assert any(ours.is_continuation(i) for i in ids)
  assert ours.decode(ids, clean_up_tokenization_spaces=True) == (
      text.lower() if lowercase else text)
  # Ids outside the vocabulary are left out, as transformers leaves them.
  assert ours.decode(ids + [len(ours) + 7]) == theirs.decode(ids + [len(ours) + 7])
