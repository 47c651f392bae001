"""Loading tokenizers: `SentencePieceTokenizer` (the interface of `wordpiece.WordPiece`, so the
dataset builder and whole-word masking take either), the special-token ids and styles all
tokenizers share, and `load_tokenizer` (a WordPiece vocab.txt, a SentencePiece model or a
Hugging Face tokenizer.json, picked from the path). Training one: `sentencepiece_training`.

Special-token ids are fixed per style, and training is deterministic: the same texts and
arguments give a byte-identical spm.model.

The guide: docs/data.md, 'SentencePiece tokenizers'.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from bertjax.data import hf_tokenizers
from bertjax.data.errors import CorpusError
from bertjax.data.special_tokens import (
    EOT_TOKEN,
    SPECIAL_NAMES,
    SpecialIds,
    sentinel_piece,
    style_of,
)
from bertjax.data.wordpiece import BERT_SPECIAL_TOKENS, WordPiece

MODEL_FILE = "spm.model"
VOCAB_FILE = "spm.vocab"
# Not "tokenizer_config.json": that name belongs to Hugging Face, and tokenizer files travel
# into exported Hugging Face directories.
CONFIG_FILE = "bertjax_tokenizer.json"
GPT_UNK_TOKEN = "<unk>"
GPT_PAD_TOKEN = "<pad>"
# SentencePiece's word-boundary mark: a piece starting with it starts a word.
WORD_START = "\u2581"
# Lines longer than this many bytes are dropped by SentencePiece's trainer (its default, 4192,
# would silently drop long GPT-style paragraphs).
MAX_LINE_BYTES = 16384

STYLES = ("bert", "gpt", "t5", "bart")
MODEL_TYPES = ("unigram", "bpe")
# T5's sentinels: <extra_id_0> ... <extra_id_99>, appended last-first after training.
NUM_SENTINELS = 100
BART_MASK_TOKEN = "<mask>"


# Name -> piece for BERT style, in id order.
BERT_SPECIALS = dict(zip(("pad", "unk", "cls", "sep", "mask"), BERT_SPECIAL_TOKENS, strict=True))
# Pieces looked up for each special name in a loaded model (ours or someone else's).
_PIECES_BY_NAME = {
    "pad": ("[PAD]", GPT_PAD_TOKEN), "cls": ("[CLS]",), "sep": ("[SEP]",),
    "mask": ("[MASK]", BART_MASK_TOKEN), "eot": (EOT_TOKEN,), "bos": ("<s>",),
    "eos": ("</s>",),
}


class SentencePieceTokenizer(SpecialIds):
  """A loaded SentencePiece model with WordPiece's interface; special-token ids as
  properties (None where the model has no such token)."""

  def __init__(self, path: Path, processor: spm.SentencePieceProcessor,
               num_threads: int | None = None):
    self.path = path
    self._sp = processor
    if num_threads is None:
      # The CPUs this process may use (cpu_count where affinity is not available).
      affinity = getattr(os, "sched_getaffinity", None)
      num_threads = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    self.num_threads = num_threads
    size = processor.get_piece_size()
    self._special: dict[str, int | None] = {"unk": processor.unk_id()}
    for name, pieces in _PIECES_BY_NAME.items():
      self._special[name] = next((i for i in map(self._lookup, pieces) if i is not None), None)
    if processor.pad_id() >= 0:
      self._special["pad"] = processor.pad_id()
    self._special = {name: self._special[name] for name in SPECIAL_NAMES}
    self.first_sentinel = self._lookup(sentinel_piece(0))
    self.style = style_of(self._special, self.first_sentinel)
    # Case folding lives in the model's normalisation rule; probe it.
    self.lowercase = processor.normalize("ABC").replace(WORD_START, "") == "abc"
    # Whether a text's first word gets a word-start space (SentencePiece's dummy prefix: bert,
    # t5, bart). Without it (gpt, as GPT-2) texts that follow one another carry their spaces.
    self.dummy_prefix = processor.encode("a", out_type=str)[0].startswith(WORD_START)
    # Control and unknown pieces: what `decode` skips or spells out.
    self._is_special = [processor.is_control(i) or processor.is_unknown(i) for i in range(size)]
    # Precomputed: masking asks once per token.
    self._continuation = [
        not (processor.is_control(i) or processor.is_unknown(i) or processor.is_byte(i)
             or processor.is_unused(i) or processor.id_to_piece(i).startswith(WORD_START))
        for i in range(size)]

  @classmethod
  def from_model(cls, path: str | Path, *, require: str | None = None,
                 num_threads: int | None = None) -> SentencePieceTokenizer:
    """Loads a SentencePiece `.model` file. `require="bert"` checks for [PAD] [UNK] [CLS] [SEP]
    [MASK], `require="gpt"` for <|endoftext|>; `num_threads` for `encode_batch` (default:
    the CPUs this process may use)."""
    path = Path(path)
    if not path.is_file():
      raise CorpusError(f"{path}: no such SentencePiece model file")
    if require not in (None, *STYLES):
      raise ValueError(f"require {require!r}: expected None or one of {', '.join(STYLES)}")
    processor = spm.SentencePieceProcessor()
    try:
      processor.load(str(path))
    except (RuntimeError, OSError) as e:
      raise CorpusError(f"{path}: not a SentencePiece model ({e})") from None
    tokenizer = cls(path, processor, num_threads)
    if require == "bert":
      missing = [t for t in BERT_SPECIAL_TOKENS if tokenizer._lookup(t) is None]
      if missing:
        raise CorpusError(f"{path}: SentencePiece model lacks the special token(s) "
                          f"{', '.join(missing)} that BERT needs (train it with style='bert')")
    elif require == "gpt" and tokenizer.eot_id is None:
      raise CorpusError(f"{path}: SentencePiece model lacks the {EOT_TOKEN} token that GPT "
                        "needs (train it with style='gpt')")
    elif require in ("t5", "bart") and tokenizer.style != require:
      needs = "the sentinels <extra_id_N>" if require == "t5" else "<s>, <mask>"
      raise CorpusError(f"{path}: SentencePiece model lacks the special tokens {require} needs "
                        f"(</s> and {needs}; train it with style='{require}')")
    return tokenizer

  @classmethod
  def from_dir(cls, path: str | Path, *, require: str | None = None,
               num_threads: int | None = None) -> SentencePieceTokenizer:
    """Loads `path`/spm.model (as written by `sentencepiece_training.train_sentencepiece`);
    see `from_model`."""
    path = Path(path)
    if not (path / MODEL_FILE).is_file():
      raise CorpusError(f"{path}: no {MODEL_FILE} in this directory")
    return cls.from_model(path / MODEL_FILE, require=require, num_threads=num_threads)

  def _lookup(self, piece: str) -> int | None:
    # piece_to_id answers unknown pieces with the unk id; tell the two apart.
    i = self._sp.piece_to_id(piece)
    return i if self._sp.id_to_piece(i) == piece else None

  def __len__(self) -> int:
    return self._sp.get_piece_size()

  def __repr__(self) -> str:
    return (f"SentencePieceTokenizer({str(self.path)!r}, style={self.style!r}, "
            f"size={len(self)}, lowercase={self.lowercase})")

  def token_id(self, token: str) -> int:
    """Id of piece `token`; KeyError if the model has no such piece (like WordPiece)."""
    i = self._lookup(token)
    if i is None:
      raise KeyError(token)
    return i

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, no special tokens added."""
    return self._sp.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """`[encode(t) for t in texts]`, encoded by SentencePiece's thread pool."""
    return self._sp.encode(list(texts), num_threads=self.num_threads)

  def tokens(self, text: str) -> list[str]:
    """The pieces of `text` ("▁" marks a word start), no special tokens added."""
    return self._sp.encode(text, out_type=str)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids`, as SentencePiece decodes it. `skip_special_tokens`: the control and
    unknown pieces ([CLS], [SEP], [MASK], [PAD], [UNK], <|endoftext|>, ...) are left out;
    otherwise each is spelled out as its piece ("[CLS] the river[SEP]": the spaces the pieces
    hold are kept, none is added). The default, True unlike `WordPiece.decode`'s, is what text
    generation shows (transformers' text-generation pipeline decodes so)."""
    ids = [int(i) for i in ids]
    special = [0 <= i < len(self._is_special) and self._is_special[i] for i in ids]
    if skip_special_tokens:
      return self._sp.decode([i for i, s in zip(ids, special) if not s])
    out: list[str] = []
    run: list[int] = []  # text pieces since the last special one
    for i, is_special in zip(ids + [None], special + [True]):
      if not is_special:
        run.append(i)  # an id outside the vocabulary: SentencePiece's error
        continue
      if run:
        text = self._sp.decode(run)
        # SentencePiece drops the dummy prefix's space of what it decodes first; a run after
        # a special piece is not first, so its word-start space is put back.
        if out and self._sp.id_to_piece(run[0]).startswith(WORD_START) \
            and not text.startswith(" "):
          text = " " + text
        out.append(text)
        run = []
      if i is not None:
        out.append(self._sp.id_to_piece(i))
    return "".join(out)

  def is_continuation(self, token_id: int) -> bool:
    """True for pieces that continue a word (no leading "▁", not special or byte), which
    whole-word masking groups with the previous piece (without a dummy prefix, gpt, also a
    text's first piece)."""
    if not 0 <= token_id < len(self._continuation):
      raise IndexError(f"token id {token_id} outside the vocabulary (size "
                       f"{len(self._continuation)})")
    return self._continuation[token_id]


def load_tokenizer(path: str | Path, lowercase: bool | None = None, *,
                   require: str | None = None
                   ) -> WordPiece | SentencePieceTokenizer | hf_tokenizers.HuggingFaceTokenizer:
  """The tokenizer at `path`: a vocab.txt file, or a directory holding one -> WordPiece
  (`lowercase` None: the casing recorded next to the vocab, see `recorded_lowercase`, else True
  as bert-base-uncased); a SentencePiece `.model` file or a directory holding spm.model ->
  SentencePieceTokenizer; a Hugging Face tokenizer.json, or a directory holding one (and
  neither of bertjax's own files) -> HuggingFaceTokenizer (bertjax.data.hf_tokenizers: the ids
  transformers' AutoTokenizer gives).

  For SentencePiece and Hugging Face tokenizers `lowercase` is ignored: case folding is part of
  their normalisation (`tokenizer.lowercase` says which). `require` ("bert"/"gpt"/"t5"/"bart")
  checks that the special tokens of that use are present (a WordPiece vocab always has BERT's).
  """
  path = Path(path)
  expected = ("expected a WordPiece vocab.txt, a SentencePiece .model file, a Hugging Face "
              f"tokenizer.json, or a directory holding vocab.txt, {MODEL_FILE} or "
              "tokenizer.json")
  if path.is_dir():
    has_vocab, has_model = (path / "vocab.txt").is_file(), (path / MODEL_FILE).is_file()
    if has_vocab and has_model:
      raise CorpusError(f"{path}: holds both vocab.txt and {MODEL_FILE}; which tokenizer is "
                        "meant is ambiguous, point at the file instead")
    if has_model:
      return SentencePieceTokenizer.from_dir(path, require=require)
    if has_vocab:
      path = path / "vocab.txt"
    elif (path / hf_tokenizers.TOKENIZER_JSON).is_file():
      return hf_tokenizers.HuggingFaceTokenizer.from_dir(path, require=require)
    else:
      raise CorpusError(f"{path}: no tokenizer in this directory; "
                        f"{hf_tokenizers.legacy_hint(path) or expected}")
  elif not path.exists():
    raise CorpusError(f"{path}: no such tokenizer file or directory; {expected}")
  if path.suffix == ".model":
    return SentencePieceTokenizer.from_model(path, require=require)
  if path.name == hf_tokenizers.TOKENIZER_JSON:
    return hf_tokenizers.HuggingFaceTokenizer.from_dir(path.parent, require=require)
  if path.suffix == ".txt":
    if require == "gpt":
      raise CorpusError(f"{path}: a WordPiece vocabulary has no {EOT_TOKEN} token for GPT use; "
                        "train a SentencePiece model with style='gpt'")
    if lowercase is None:
      recorded = recorded_lowercase(path.parent)
      lowercase = True if recorded is None else recorded
    return WordPiece.from_vocab(path, lowercase=lowercase)
  raise CorpusError(f"{path}: not a known tokenizer file; {expected}")


def recorded_lowercase(directory: str | Path) -> bool | None:
  """The casing a WordPiece vocab.txt in `directory` was used with: bertjax_tokenizer.json's
  "lowercase" (written by the dataset builder and export), else a Hugging Face
  tokenizer_config.json's "do_lower_case"; None when neither says."""
  directory = Path(directory)
  for name, key in ((CONFIG_FILE, "lowercase"), ("tokenizer_config.json", "do_lower_case")):
    if (directory / name).is_file():
      try:
        value = json.loads((directory / name).read_text(encoding="utf-8")).get(key)
      except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise CorpusError(f"{directory / name}: not a JSON object") from None
      if isinstance(value, bool):
        return value
  return None


def special_ids(tokenizer) -> dict[str, int | None]:
  """{"pad", "unk", "cls", "sep", "mask", "eot"} -> id, None where the tokenizer has none."""
  if isinstance(tokenizer, SpecialIds):
    return dict(tokenizer._special)
  if isinstance(tokenizer, WordPiece):
    # from_vocab guarantees BERT's five; WordPiece vocabularies have no end-of-text token.
    ids: dict[str, int | None] = {
        name: tokenizer.token_id(token) for name, token in BERT_SPECIALS.items()}
    ids.update(eot=None, bos=None, eos=None)
    return ids
  raise TypeError(f"special_ids: expected a WordPiece, SentencePiece or Hugging Face "
                  f"tokenizer, got {type(tokenizer).__name__}")
