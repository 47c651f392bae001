"""Published checkpoints' tokenizers (bertjax.data.hf_tokenizers): a directory that holds a
Hugging Face tokenizer.json, built here with the `tokenizers` library in each kind the
published families use and saved through `transformers`, drives `data build` with the ids
`transformers.AutoTokenizer.from_pretrained(DIR)` gives, on every document of the embedded
corpus and on multi-byte UTF-8 lines; the special tokens are the checkpoint's own; whole-word
masking's word starts follow the tokenizer's own word marks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

import hf_models  # noqa: F401  (skips without torch / transformers; quiet logging)
from bertjax import cli
from bertjax.data import records
from bertjax.data.errors import CorpusError, SkipCounts
from bertjax.data.hf_tokenizers import HuggingFaceTokenizer
from bertjax.data.prepare import corpus_sentences
from bertjax.data.sentences import split_sentences
from bertjax.data.shards import ShardRecords
from bertjax.data.sources import parse_sources, read_source
from bertjax.data.tokenizers import load_tokenizer, special_ids

transformers = pytest.importorskip("transformers", reason="the hf extra provides the reference")

# Multi-byte UTF-8 the corpus sample lacks: Cyrillic, CJK, emoji, accents, a long word.
MULTIBYTE = ["Москва — столица России. Она стоит на реке Москве.",
             "東京は日本の首都です。北京は中国の首都です。",
             "smile 😀🎉 and a family 👨‍👩‍👧 emoji, naïve café façade.",
             "Pneumonoultramicroscopicsilicovolcanoconiosis is long; so is ΑΒΓΔ."]
VOCAB = 600
TRAINING_SENTENCES = 1500


def _byte_level_bpe(specials: list[str]) -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(_training_texts(), trainer)
  return tok


def _unigram(specials: list[str], unk: str) -> Tokenizer:
  tok = Tokenizer(models.Unigram())
  tok.normalizer = normalizers.NFKC()
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  trainer = trainers.UnigramTrainer(vocab_size=VOCAB, special_tokens=specials, unk_token=unk,
                                    show_progress=False)
  tok.train_from_iterator(_training_texts(), trainer)
  return tok


def _texts() -> list[str]:
  """The text the parity is checked on: every sentence of the embedded corpus, then
  MULTIBYTE."""
  return list(corpus_sentences(parse_sources("embedded"))) + MULTIBYTE


def _training_texts() -> list[str]:
  """What the tokenizers are trained on: the corpus's first sentences (the rest, unseen,
  meets pieces and bytes a vocabulary of its own text would not)."""
  return _texts()[:TRAINING_SENTENCES] + MULTIBYTE[:2]


def gpt2_kind() -> tuple[Tokenizer, dict]:
  """GPT-2's: byte-level BPE, no prefix space, <|endoftext|> as bos, eos and unk."""
  return _byte_level_bpe(["<|endoftext|>"]), dict(
      bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>")


def roberta_kind() -> tuple[Tokenizer, dict]:
  """RoBERTa's (and BART's, ModernBERT's): byte-level BPE, <s> A </s></s> B </s>."""
  tok = _byte_level_bpe(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
  tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                    ("<s>", tok.token_to_id("<s>")))
  return tok, dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
                   unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")


def xlmr_kind() -> tuple[Tokenizer, dict]:
  """XLM-R's (and CamemBERT's): Unigram with Metaspace, fairseq's <s> <pad> </s> <unk> first."""
  tok = _unigram(["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "<unk>")
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
      special_tokens=[("<s>", 0), ("</s>", 2)])
  return tok, dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
                   unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")


def mt5_kind() -> tuple[Tokenizer, dict]:
  """mT5's: Unigram with Metaspace, <pad> </s> <unk>, sentinels <extra_id_N> at the end."""
  tok = _unigram(["<pad>", "</s>", "<unk>"], "<unk>")
  tok.add_special_tokens([f"<extra_id_{i}>" for i in reversed(range(10))])
  tok.post_processor = processors.TemplateProcessing(
      single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
  return tok, dict(eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


def wordpiece_kind() -> tuple[Tokenizer, dict]:
  """BERT's, as a tokenizer.json alone: lower-casing normaliser, WordPiece "##"."""
  tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
  tok.normalizer = normalizers.BertNormalizer(lowercase=True)
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.decoder = decoders.WordPiece()
  trainer = trainers.WordPieceTrainer(vocab_size=VOCAB, show_progress=False,
                                      special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                      "[MASK]"])
  tok.train_from_iterator(_training_texts(), trainer)
  tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                 ("[CLS]", tok.token_to_id("[CLS]")))
  return tok, dict(unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                   cls_token="[CLS]", mask_token="[MASK]")


def byte_fallback_kind() -> tuple[Tokenizer, dict]:
  """LLaMA's and Gemma's: BPE with byte fallback, "▁" for spaces, no pre-tokenizer; the 256
  byte tokens are ordinary vocabulary (decoded, never skipped as special)."""
  tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
  # Trained on words, as SentencePiece trains (no merge across a "▁"), then encoding as the
  # published files do: the normaliser marks the spaces, no pre-tokenizer.
  tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                special_tokens=["<unk>", "<s>", "</s>"])
  tok.train_from_iterator(_training_texts(), trainer)
  tok.pre_tokenizer = None
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                         normalizers.Replace(" ", "▁")])
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  spec = json.loads(tok.to_str())
  vocab = spec["model"]["vocab"]
  for i in range(256):
    vocab.setdefault(f"<0x{i:02X}>", len(vocab))
  return Tokenizer.from_str(json.dumps(spec)), dict(bos_token="<s>", eos_token="</s>",
                                                    unk_token="<unk>")


KINDS = {"gpt2": gpt2_kind, "roberta": roberta_kind, "xlmr": xlmr_kind, "mt5": mt5_kind,
         "wordpiece": wordpiece_kind, "byte_fallback": byte_fallback_kind}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """kind -> a directory saved by transformers' save_pretrained (tokenizer.json,
  tokenizer_config.json, special_tokens_map.json where it writes one)."""
  root = tmp_path_factory.mktemp("published-tokenizers")
  out = {}
  for kind, make in KINDS.items():
    tok, specials = make()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    fast.save_pretrained(root / kind)
    out[kind] = root / kind
  return out


def _reference(directory: Path):
  return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.mark.slow  # six tokenizers trained on the corpus (the module fixture)
@pytest.mark.parametrize("kind", KINDS)
def test_the_ids_are_autotokenizers_on_the_corpus_and_multibyte_text(saved, kind):
  ours = load_tokenizer(saved[kind])
  assert isinstance(ours, HuggingFaceTokenizer)
  reference = _reference(saved[kind])
  texts = _texts()
  want = reference(texts, add_special_tokens=False)["input_ids"]
  assert ours.encode_batch(texts) == want
  assert [ours.encode(t) for t in MULTIBYTE] == want[-len(MULTIBYTE):]
  assert len(ours) == len(reference)
  for text in MULTIBYTE:  # decoding gives the text back where the tokenizer is lossless
    if kind in ("gpt2", "roberta", "byte_fallback"):
      assert ours.decode(ours.encode(text)) == text


@pytest.mark.slow  # six tokenizers trained on the corpus (the module fixture)
@pytest.mark.parametrize("kind", KINDS)
def test_the_special_tokens_are_the_checkpoints_own(saved, kind):
  ours = load_tokenizer(saved[kind])
  reference = _reference(saved[kind])
  ids = special_ids(ours)
  for name, attribute in (("pad", "pad_token_id"), ("unk", "unk_token_id"),
                          ("cls", "cls_token_id"), ("sep", "sep_token_id"),
                          ("mask", "mask_token_id"), ("bos", "bos_token_id"),
                          ("eos", "eos_token_id")):
    assert ids[name] == getattr(reference, attribute), (kind, name)
  assert ours.style == {"gpt2": "gpt", "roberta": "bert", "xlmr": "bert", "mt5": "t5",
                        "wordpiece": "bert", "byte_fallback": "gpt"}[kind]
  # What frames a pair in the bertjax instance builders is the checkpoint's template's
  # tokens: RoBERTa's <s> A </s></s> B </s> and BERT's [CLS] A [SEP] B [SEP].
  if kind in ("roberta", "xlmr", "wordpiece"):
    a, b = ours.encode("the river"), ours.encode("a town")
    pair = reference("the river", "a town")["input_ids"]
    middle = [ids["sep"], ids["sep"]] if kind != "wordpiece" else [ids["sep"]]
    assert pair == [ids["cls"], *a, *middle, *b, ids["sep"]]


@pytest.mark.slow  # six tokenizers trained on the corpus (the module fixture)
@pytest.mark.parametrize("kind", KINDS)
def test_word_starts_follow_the_tokenizers_own_marks(saved, kind):
  ours = load_tokenizer(saved[kind])
  text = "the riverbanks of Pneumonoultramicroscopicsilicovolcanoconiosis"
  tokens, ids = ours.tokens(text), ours.encode(text)
  words = []
  for token, i in zip(tokens, ids, strict=True):
    if ours.is_continuation(i) and words:
      words[-1].append(token)
    else:
      words.append([token])
  # Every word of the text is one group (a tokenizer without a prefix space, GPT-2's and
  # RoBERTa's, also starts its first word without a mark: grouped as a continuation of
  # nothing, it opens the first group).
  assert len(words) == len(text.split()), (kind, words)
  for i in ours._added:
    assert not ours.is_continuation(i)


@pytest.mark.slow  # six tokenizers trained on the corpus (the module fixture)
@pytest.mark.parametrize("kind", ["gpt2", "roberta", "xlmr", "mt5"])
def test_data_build_with_a_published_tokenizer_gives_autotokenizers_ids(saved, tmp_path, kind):
  """`bertjax data build --tokenizer DIR` as a user runs it, on the embedded corpus and on a
  file of multi-byte lines: every sentence of every record equals AutoTokenizer's ids of that
  sentence's text (with its leading space where the tokenizer has no prefix space)."""
  lines = tmp_path / "multibyte.txt"
  lines.write_text("\n".join(MULTIBYTE) + "\n", encoding="utf-8")
  sources = ["embedded", f"lines:{lines}"]
  out = tmp_path / "dataset"
  assert cli.main(["data", "build", "--source", sources[0], "--source", sources[1],
                   "--tokenizer", str(saved[kind]), "--out", str(out),
                   "--num-shards", "2"]) == 0
  reference = _reference(saved[kind])
  ours = load_tokenizer(saved[kind])
  built = records.BuiltDataset.open(out)
  assert sorted(p.name for p in built.tokenizer_dir.iterdir()) == sorted(
      p.name for p in saved[kind].iterdir())
  documents = {}
  for name in built.source_names:
    for split in records.SPLITS:
      for path in built.shard_paths(name, split):
        for record in ShardRecords([path]):
          doc = records.decode_record(record)
          documents[doc.key] = doc.sentences()
  checked = 0
  for spec in parse_sources(sources):
    for doc in read_source(spec, SkipCounts()):
      texts = []
      for paragraph in doc.paragraphs:
        texts += ([paragraph] if paragraph.strip() else []) if doc.sentences_given else \
            split_sentences(paragraph, "en")
      if not ours.dummy_prefix:
        texts[1:] = [" " + text for text in texts[1:]]
      want = [ids for ids in reference(texts, add_special_tokens=False)["input_ids"] if ids]
      assert documents[f"{spec.name}:{doc.id}"] == want, doc.id
      checked += 1
  assert checked == len(documents) > len(MULTIBYTE)


@pytest.mark.fast  # the fast tier's test of bertjax.data.hf_tokenizers
def test_published_tokenizers_load_and_bad_ones_are_one_line_errors(tmp_path):
  # A small RoBERTa-style tokenizer saved by transformers: loaded with its own special tokens.
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(MULTIBYTE, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
      cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
  ).save_pretrained(tmp_path / "roberta")
  ours = load_tokenizer(tmp_path / "roberta" / "tokenizer.json", require="bert")
  assert (ours.cls_id, ours.sep_id, ours.pad_id, ours.mask_id, ours.eot_id) == (0, 2, 1, 4, None)
  assert ours.encode(MULTIBYTE[2]) == _reference(tmp_path / "roberta")(
      MULTIBYTE[2], add_special_tokens=False)["input_ids"]
  assert not ours.dummy_prefix and ours.style == "bert" and not ours.lowercase
  with pytest.raises(CorpusError, match=r"roberta/tokenizer.json: the tokenizer has no eot "
                     r"token\(s\) that gpt needs \(special tokens found: pad, unk, cls, sep, "
                     r"mask, bos, eos\)"):
    load_tokenizer(tmp_path / "roberta", require="gpt")
  # A slow tokenizer's files without tokenizer.json: what to run, in one line.
  slow = tmp_path / "slow"
  slow.mkdir()
  (slow / "vocab.json").write_text(json.dumps({"a": 0}))
  (slow / "merges.txt").write_text("#version: 0.2\n")
  with pytest.raises(CorpusError, match=r"holds vocab.json, merges.txt but no tokenizer.json; "
                     r"write one with transformers: AutoTokenizer.from_pretrained"):
    load_tokenizer(slow)
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "tokenizer.json").write_text('{"model": ')
  with pytest.raises(CorpusError, match="broken/tokenizer.json: not a tokenizer.json") as e:
    load_tokenizer(broken)
  assert "\n" not in str(e.value)
