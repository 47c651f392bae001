"""Tokenizers beyond a given vocab.txt: `train_sentencepiece` (unigram or BPE; bert, gpt, t5 or
bart style), `SentencePieceTokenizer` (the interface of `wordpiece.WordPiece`, so the dataset
builder and whole-word masking take either) and `load_tokenizer` (either kind, picked from the
path).

Special-token ids are fixed per style, and training is deterministic: the same texts and
arguments give a byte-identical spm.model.

The guide: docs/data.md, 'SentencePiece tokenizers'.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import sentencepiece as spm

from bertjax.data.errors import CorpusError
from bertjax.data.sentencepiece_proto import model_proto_class
from bertjax.data.wordpiece import BERT_SPECIAL_TOKENS, WordPiece

MODEL_FILE = "spm.model"
VOCAB_FILE = "spm.vocab"
# Not "tokenizer_config.json": that name belongs to Hugging Face, and tokenizer files travel
# into exported Hugging Face directories.
CONFIG_FILE = "bertjax_tokenizer.json"
EOT_TOKEN = "<|endoftext|>"
GPT_UNK_TOKEN = "<unk>"
GPT_PAD_TOKEN = "<pad>"
# SentencePiece's word-boundary mark: a piece starting with it starts a word.
WORD_START = "\u2581"
# Lines longer than this many bytes are dropped by SentencePiece's trainer (its default, 4192,
# would silently drop long GPT-style paragraphs).
MAX_LINE_BYTES = 16384

STYLES = ("bert", "gpt", "t5", "bart")
MODEL_TYPES = ("unigram", "bpe")
SPECIAL_NAMES = ("pad", "unk", "cls", "sep", "mask", "eot", "bos", "eos")
# T5's sentinels: <extra_id_0> ... <extra_id_99>, appended last-first after training.
NUM_SENTINELS = 100
BART_MASK_TOKEN = "<mask>"


def sentinel_piece(index: int) -> str:
  return f"<extra_id_{index}>"

# Name -> piece, in id order, for each style.
_BERT_SPECIALS = dict(zip(("pad", "unk", "cls", "sep", "mask"), BERT_SPECIAL_TOKENS, strict=True))
_STYLE_SPECIALS = {
    "bert": _BERT_SPECIALS,
    "gpt": {"unk": GPT_UNK_TOKEN, "eot": EOT_TOKEN, "pad": GPT_PAD_TOKEN},
    "t5": {"pad": "<pad>", "eos": "</s>", "unk": "<unk>"},
    "bart": {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>"},
}
# Pieces appended after training (control pieces, never produced from text), in id order.
_APPENDED = {"t5": [sentinel_piece(i) for i in reversed(range(NUM_SENTINELS))],
             "bart": [BART_MASK_TOKEN]}
# Pieces looked up for each special name in a loaded model (ours or someone else's).
_PIECES_BY_NAME = {
    "pad": ("[PAD]", GPT_PAD_TOKEN), "cls": ("[CLS]",), "sep": ("[SEP]",),
    "mask": ("[MASK]", BART_MASK_TOKEN), "eot": (EOT_TOKEN,), "bos": ("<s>",),
    "eos": ("</s>",),
}


def train_sentencepiece(texts: Iterable[str], out_dir: str | Path, *, vocab_size: int,
                        model_type: Literal["unigram", "bpe"],
                        style: Literal["bert", "gpt", "t5", "bart"], lowercase: bool = False,
                        character_coverage: float = 0.9995, max_sentences: int = 2_000_000,
                        seed: int = 0, num_threads: int = 1, verbose: bool = False) -> Path:
  """Trains a SentencePiece model on `texts` and writes `out_dir`/spm.model, spm.vocab and
  bertjax_tokenizer.json; returns `out_dir` (what `load_tokenizer` takes).

  Each text is split into lines (sentences, ideally: SentencePiece trains on lines); blank
  lines are skipped. The texts are streamed once; when there are more than `max_sentences`
  lines, a uniform sample of that many (reproducible from `seed`) is kept in memory and
  trained on (here, from `seed`: SentencePiece's own sampling is not reproducible across
  processes). `num_threads` defaults to 1: unigram training's scores and pieces depend on the
  thread count. docs/data.md, 'SentencePiece tokenizers', has the special-token layout of each
  `style`. `verbose` shows SentencePiece's training log.
  """
  if model_type not in MODEL_TYPES:
    raise ValueError(f"model_type {model_type!r}: expected one of {', '.join(MODEL_TYPES)}")
  if style not in STYLES:
    raise ValueError(f"style {style!r}: expected one of {', '.join(STYLES)}")
  if not 0.0 < character_coverage <= 1.0:
    raise ValueError(f"character_coverage {character_coverage}: expected a value in (0, 1]")
  if max_sentences < 1:
    raise ValueError(f"max_sentences {max_sentences}: expected at least 1")
  if num_threads < 1:
    raise ValueError(f"num_threads {num_threads}: expected at least 1")
  specials = _STYLE_SPECIALS[style]
  lossless = style in ("gpt", "bart")
  fixed = len(specials) + (256 if lossless else 0)
  # Checked before reading the corpus, so an obviously wrong size fails at once.
  if not isinstance(vocab_size, int) or vocab_size <= fixed:
    raise ValueError(
        f"vocab_size {vocab_size} is too small: {style} style reserves {fixed} ids ("
        f"{len(specials)} special tokens{' + 256 byte pieces' if lossless else ''}) "
        "before the alphabet and any learned piece")

  lines, seen = _sample_lines(texts, max_sentences, seed)
  if not lines:
    raise CorpusError("train_sentencepiece: no sentences to train on (the texts were empty "
                      "or blank)")

  options = dict(
      vocab_size=vocab_size, model_type=model_type, character_coverage=character_coverage,
      num_threads=num_threads, max_sentence_length=MAX_LINE_BYTES,
      # Sampling was done above, reproducibly; SentencePiece must take every line given.
      input_sentence_size=0, shuffle_input_sentence=False,
      bos_id=-1, minloglevel=0 if verbose else 2)
  if style == "bert":
    options.update(
        pad_id=0, unk_id=1, eos_id=-1, pad_piece="[PAD]", unk_piece="[UNK]",
        control_symbols=["[CLS]", "[SEP]", "[MASK]"],
        normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc")
  elif style == "t5":
    options.update(pad_id=0, eos_id=1, unk_id=2, pad_piece="<pad>", eos_piece="</s>",
                   unk_piece="<unk>",
                   normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc")
  else:
    ids = (dict(unk_id=0, eos_id=1, pad_id=2, unk_piece=GPT_UNK_TOKEN, eos_piece=EOT_TOKEN,
                pad_piece=GPT_PAD_TOKEN) if style == "gpt" else
           dict(bos_id=0, pad_id=1, eos_id=2, unk_id=3, bos_piece="<s>", pad_piece="<pad>",
                eos_piece="</s>", unk_piece="<unk>"))
    options.update(
        **ids, byte_fallback=True,
        # GPT: no space before a text's first word, so a continuation's tokens decode with
        # theirs in any tokenizer (transformers' pipeline decodes the new tokens alone).
        add_dummy_prefix=style != "gpt",
        # Lossless: no NFKC folding, no whitespace squeezing (only case folding if asked).
        normalization_rule_name="nfkc_cf" if lowercase else "identity",
        remove_extra_whitespaces=False)

  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                   **options)
  except RuntimeError as e:
    raise _readable_training_error(e, vocab_size, style, fixed, len(lines)) from None
  del lines

  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / MODEL_FILE).write_bytes(_append_pieces(model.getvalue(), _APPENDED.get(style, [])))
  tokenizer = SentencePieceTokenizer.from_model(out_dir / MODEL_FILE, require=style)
  processor = tokenizer._sp
  # The same format as spm_train's .vocab (ostream's default float format is %g).
  (out_dir / VOCAB_FILE).write_text(
      "".join(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n"
              for i in range(len(tokenizer))), encoding="utf-8")
  config = {
      "type": "sentencepiece", "model": MODEL_FILE, "style": style, "model_type": model_type,
      "lowercase": lowercase, "vocab_size": len(tokenizer),
      "special_tokens": dict(specials),
      "special_ids": {name: tokenizer._special[name] for name in specials},
      "training": {"sentences_seen": seen, "sentences_used": min(seen, max_sentences),
                   "character_coverage": character_coverage, "seed": seed,
                   "num_threads": num_threads},
  }
  (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                     encoding="utf-8")
  return out_dir


def appended_pieces(style: str) -> int:
  """How many pieces a style adds after training (T5's 100 sentinels, BART's <mask>): a
  vocabulary of N ids trains N minus these."""
  return len(_APPENDED.get(style, []))


def _append_pieces(model: bytes, pieces: list[str]) -> bytes:
  """The serialised model with control `pieces` added at the end of its vocabulary
  (SentencePiece's trainer puts its own control symbols first)."""
  if not pieces:
    return model
  model_proto = model_proto_class()
  proto = model_proto.FromString(model)
  for piece in pieces:
    proto.pieces.add(piece=piece, score=0.0, type=model_proto.SentencePiece.CONTROL)
  return proto.SerializeToString()


def _sample_lines(texts: Iterable[str], max_sentences: int, seed: int) -> tuple[list[str], int]:
  """Non-blank lines of `texts`: all of them, or a uniform reservoir sample of
  `max_sentences` (Algorithm R with `random.Random(seed)`); and how many there were."""
  if isinstance(texts, str):
    raise TypeError("train_sentencepiece: texts must be an iterable of strings, not one string")
  rng = random.Random(seed)
  kept: list[str] = []
  seen = 0
  for text in texts:
    if not isinstance(text, str):
      raise TypeError(f"train_sentencepiece: texts must be strings, got {type(text).__name__}")
    for line in text.splitlines():
      if not line.strip():
        continue
      seen += 1
      if len(kept) < max_sentences:
        kept.append(line)
      else:
        slot = rng.randrange(seen)
        if slot < max_sentences:
          kept[slot] = line
  return kept, seen


def _readable_training_error(error: RuntimeError, vocab_size: int, style: str, fixed: int,
                             lines: int) -> Exception:
  """SentencePiece's check failures (`INTERNAL: src/...cc(638) [...] ...`) as sentences."""
  message = str(error)
  too_small = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
  if too_small:
    needed = int(too_small.group(2))
    return ValueError(
        f"vocab_size {vocab_size} is too small: the {fixed} reserved ids of {style} style plus "
        f"the alphabet (characters within character_coverage) need at least {needed}; raise "
        "vocab_size or lower character_coverage")
  too_large = re.search(r"too high \((\d+)\)\. Please set it to a value <= (\d+)", message)
  if too_large:
    return ValueError(
        f"vocab_size {vocab_size} is too large for this corpus ({lines:,} lines): SentencePiece "
        f"can learn at most {too_large.group(2)} pieces from it; use vocab_size <= "
        f"{too_large.group(2)} or train on more text")
  # Anything else: keep SentencePiece's words, minus the source location noise.
  detail = re.sub(r"^\w+: src/\S+ \[[^\]]*\]\s*", "", message).strip() or message
  return RuntimeError(f"SentencePiece training failed: {detail}")


class SentencePieceTokenizer:
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
    if all(self._special[n] is not None for n in ("pad", "cls", "sep", "mask")):
      self.style: str | None = "bert"
    elif self._special["eot"] is not None:
      self.style = "gpt"
    elif self._special["eos"] is not None and self.first_sentinel is not None:
      self.style = "t5"
    elif all(self._special[n] is not None for n in ("bos", "eos", "mask")):
      self.style = "bart"
    else:
      self.style = None
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
    """Loads `path`/spm.model (as written by `train_sentencepiece`); see `from_model`."""
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

  @property
  def pad_id(self) -> int | None:
    return self._special["pad"]

  @property
  def unk_id(self) -> int | None:
    return self._special["unk"]

  @property
  def cls_id(self) -> int | None:
    return self._special["cls"]

  @property
  def sep_id(self) -> int | None:
    return self._special["sep"]

  @property
  def mask_id(self) -> int | None:
    return self._special["mask"]

  @property
  def eot_id(self) -> int | None:
    return self._special["eot"]


def load_tokenizer(path: str | Path, lowercase: bool | None = None, *,
                   require: str | None = None
                   ) -> WordPiece | SentencePieceTokenizer:
  """The tokenizer at `path`: a vocab.txt file, or a directory holding one -> WordPiece
  (`lowercase` None: the casing recorded next to the vocab, see `recorded_lowercase`, else True
  as bert-base-uncased); a SentencePiece `.model` file or a
  directory holding spm.model -> SentencePieceTokenizer.

  For SentencePiece `lowercase` is ignored: case folding is part of the trained model's
  normalisation (`tokenizer.lowercase` says which). `require` ("bert"/"gpt") checks that the
  special tokens of that use are present (a WordPiece vocab always has BERT's).
  """
  path = Path(path)
  expected = ("expected a WordPiece vocab.txt, a SentencePiece .model file, or a directory "
              f"holding vocab.txt or {MODEL_FILE}")
  if path.is_dir():
    has_vocab, has_model = (path / "vocab.txt").is_file(), (path / MODEL_FILE).is_file()
    if has_vocab and has_model:
      raise CorpusError(f"{path}: holds both vocab.txt and {MODEL_FILE}; which tokenizer is "
                        "meant is ambiguous, point at the file instead")
    if has_model:
      return SentencePieceTokenizer.from_dir(path, require=require)
    if has_vocab:
      path = path / "vocab.txt"
    else:
      raise CorpusError(f"{path}: no tokenizer in this directory; {expected}")
  elif not path.exists():
    raise CorpusError(f"{path}: no such tokenizer file or directory; {expected}")
  if path.suffix == ".model":
    return SentencePieceTokenizer.from_model(path, require=require)
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


def special_ids(tokenizer: WordPiece | SentencePieceTokenizer) -> dict[str, int | None]:
  """{"pad", "unk", "cls", "sep", "mask", "eot"} -> id, None where the tokenizer has none."""
  if isinstance(tokenizer, SentencePieceTokenizer):
    return dict(tokenizer._special)
  if isinstance(tokenizer, WordPiece):
    # from_vocab guarantees BERT's five; WordPiece vocabularies have no end-of-text token.
    ids: dict[str, int | None] = {
        name: tokenizer.token_id(token) for name, token in _BERT_SPECIALS.items()}
    ids.update(eot=None, bos=None, eos=None)
    return ids
  raise TypeError(f"special_ids: expected a WordPiece or SentencePieceTokenizer, got "
                  f"{type(tokenizer).__name__}")
