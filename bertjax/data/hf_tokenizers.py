"""Hugging Face tokenizers: a directory holding a `tokenizer.json` of the `tokenizers` library
(byte-level BPE as GPT-2, RoBERTa, BART and ModernBERT; Unigram as XLM-R, CamemBERT and mT5;
WordPiece; BPE with byte fallback) behind the interface of bertjax's own tokenizers
(`wordpiece.WordPiece`, `tokenizers.SentencePieceTokenizer`), so that a published checkpoint's
tokenizer drives `data build`, training and evaluation with the ids
`transformers.AutoTokenizer.from_pretrained(DIR)` gives.

The special tokens are the checkpoint's own, read from tokenizer_config.json and
special_tokens_map.json as transformers reads them. The guide: docs/data.md, 'Hugging Face
tokenizers'.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, models

from bertjax.data.errors import CorpusError
from bertjax.data.special_tokens import (
  EOT_TOKEN,
  SPECIAL_NAMES,
  SpecialIds,
  sentinel_piece,
  style_of,
)

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The files of tokenizers saved before tokenizer.json existed (slow tokenizers): transformers
# converts them on load; bertjax asks for the converted file once instead.
LEGACY_FILES = ("vocab.json", "merges.txt", "sentencepiece.bpe.model", "spiece.model",
                "sentencepiece.model")
# transformers' special-token attributes -> bertjax's names for them.
_ATTRIBUTES = {"pad_token": "pad", "unk_token": "unk", "cls_token": "cls", "sep_token": "sep",
               "mask_token": "mask", "bos_token": "bos", "eos_token": "eos"}
# Where a tokenizer.json comes without transformers' files: the spellings of each special token
# the well-known checkpoints use, looked up among its added special tokens.
_KNOWN_SPELLINGS = {"pad": ("[PAD]", "<pad>"), "unk": ("[UNK]", "<unk>"),
                    "cls": ("[CLS]", "<s>"), "sep": ("[SEP]", "</s>"),
                    "mask": ("[MASK]", "<mask>"), "bos": ("<s>",), "eos": ("</s>",)}


def legacy_hint(directory: Path) -> str | None:
  """What to do with a directory of a slow tokenizer's files (no tokenizer.json), or None."""
  found = [name for name in LEGACY_FILES if (directory / name).is_file()]
  if not found:
    return None
  return (f"it holds {', '.join(found)} but no {TOKENIZER_JSON}; write one with transformers: "
          f"AutoTokenizer.from_pretrained('{directory}').save_pretrained('{directory}')")


def _token_text(value) -> str | None:
  """A special token as transformers saves it: a string or an AddedToken's dict."""
  if isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  return None


def _read_json(path: Path) -> dict:
  try:
    value = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CorpusError(f"{path}: not readable JSON ({e})") from None
  if not isinstance(value, dict):
    raise CorpusError(f"{path}: not a JSON object")
  return value


def special_tokens(directory: Path) -> dict[str, str]:
  """bertjax name -> token text of the special tokens transformers gives the tokenizer in
  `directory`: tokenizer_config.json's attributes, then special_tokens_map.json's for those
  it does not name."""
  tokens: dict[str, str] = {}
  for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
    if (directory / name).is_file():
      for attribute, value in _read_json(directory / name).items():
        text = _token_text(value)
        if attribute in _ATTRIBUTES and text is not None:
          tokens.setdefault(_ATTRIBUTES[attribute], text)
  return tokens


class HuggingFaceTokenizer(SpecialIds):
  """A tokenizer.json with bertjax's tokenizer interface: `encode` / `encode_batch` add no
  special tokens (the instance builders frame the sequences), ids as AutoTokenizer's."""

  def __init__(self, directory: Path, tokenizer: Tokenizer, specials: dict[str, str]):
    self.directory = directory
    self.path = directory / TOKENIZER_JSON
    self._tok = tokenizer
    self._tok.no_padding()
    self._tok.no_truncation()
    self._special: dict[str, int | None] = {name: None for name in SPECIAL_NAMES}
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    for name in self._special:
      text = specials.get(name)
      if text is None and not specials:  # a bare tokenizer.json
        text = next((t for t in _KNOWN_SPELLINGS.get(name, ()) if t in added), None)
      self._special[name] = None if text is None else tokenizer.token_to_id(text)
    self.first_sentinel = tokenizer.token_to_id(sentinel_piece(0))
    # The end of a document for causal LM packing: GPT's <|endoftext|>, else the end-of-sequence
    # token of a decoder's tokenizer (LLaMA's </s>): one without BERT's [CLS]/[SEP] frame, a
    # mask token or T5's sentinels.
    eot = tokenizer.token_to_id(EOT_TOKEN)
    if eot is None and self.first_sentinel is None and all(
        self._special[name] is None for name in ("cls", "sep", "mask")):
      eot = self._special["eos"]
    self._special["eot"] = eot
    self.style = style_of(self._special, self.first_sentinel)
    normalizer = tokenizer.normalizer
    self.lowercase = (normalizer is not None and normalizer.normalize_str("ABC") == "abc")
    # The ids of the special tokens: never a word's continuation, skipped by decode.
    self._added = {tokenizer.token_to_id(t) for t in added} - {None}
    self._prefix, self._marker = _word_marks(tokenizer)
    # Whether a text's first word is encoded as a word after a space (SentencePiece's dummy
    # prefix; Metaspace, or add_prefix_space). Without it, the builder gives each sentence after
    # the first its space, as the text had.
    first = tokenizer.encode("a", add_special_tokens=False).tokens
    self.dummy_prefix = bool(first) and self._marker is not None \
        and first[0].startswith(self._marker)
    self._continuation: list[bool] | None = None

  @classmethod
  def from_dir(cls, directory: str | Path, *, require: str | None = None
               ) -> HuggingFaceTokenizer:
    directory = Path(directory)
    path = directory / TOKENIZER_JSON
    try:
      tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side's errors are plain Exceptions
      reason = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise CorpusError(f"{path}: not a tokenizer.json the tokenizers library reads "
                        f"({reason})") from None
    loaded = cls(directory, tokenizer, special_tokens(directory))
    loaded._check(require)
    return loaded

  def _check(self, require: str | None) -> None:
    needs = {None: (), "bert": ("pad", "unk", "cls", "sep", "mask"), "gpt": ("eot",),
             "t5": ("pad", "eos"), "bart": ("bos", "eos", "pad", "mask")}
    if require not in needs:
      raise ValueError(f"require {require!r}: expected None, bert, gpt, t5 or bart")
    missing = [name for name in needs[require] if self._special[name] is None]
    if require == "t5" and self.first_sentinel is None:
      missing.append("sentinels <extra_id_N>")
    if missing:
      raise CorpusError(f"{self.path}: the tokenizer has no {', '.join(missing)} token(s) that "
                        f"{require} needs (special tokens found: "
                        f"{', '.join(n for n, i in self._special.items() if i is not None)})")

  def __len__(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def __repr__(self) -> str:
    return (f"HuggingFaceTokenizer({str(self.directory)!r}, style={self.style!r}, "
            f"size={len(self)}, lowercase={self.lowercase})")

  def token_id(self, token: str) -> int:
    """Id of `token`; KeyError if the vocabulary has no such token (like WordPiece)."""
    i = self._tok.token_to_id(token)
    if i is None:
      raise KeyError(token)
    return i

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, no special tokens added."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """`[encode(t) for t in texts]`, encoded in Rust (its thread pool where the process has
    not forked since using it: tokenizers' own rule, TOKENIZERS_PARALLELISM)."""
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def tokens(self, text: str) -> list[str]:
    """The tokens of `text` as the vocabulary spells them, no special tokens added."""
    return self._tok.encode(text, add_special_tokens=False).tokens

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids`, by the tokenizer's own decoder (transformers' decode without its
    optional clean-up of spaces)."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def is_continuation(self, token_id: int) -> bool:
    """True for tokens that continue a word, which whole-word masking groups with the token
    before: WordPiece's "##" tokens; for BPE and Unigram every token but those starting with the
    word-start mark ("Ġ" byte-level, "▁" Metaspace), the special and added ones, and bytes of
    byte fallback ("<0x..>"), as for SentencePiece."""
    if self._continuation is None:
      self._continuation = self._continuations()
    if not 0 <= token_id < len(self._continuation):
      raise IndexError(f"token id {token_id} outside the vocabulary (size "
                       f"{len(self._continuation)})")
    return self._continuation[token_id]

  def _continuations(self) -> list[bool]:
    out = [False] * len(self)
    for token, i in self._tok.get_vocab(with_added_tokens=True).items():
      if i in self._added or i >= len(out):
        continue
      if self._prefix is not None:  # WordPiece
        out[i] = token.startswith(self._prefix)
      elif self._marker is not None:
        out[i] = not (token.startswith(self._marker)
                      or (len(token) == 6 and token.startswith("<0x") and token.endswith(">")))
    return out


def _word_marks(tokenizer: Tokenizer) -> tuple[str | None, str | None]:
  """(WordPiece's continuing-subword prefix or None, the mark a word-starting token begins
  with or None): probed from how "a b" encodes, so that every pre-tokenizer and normaliser
  (ByteLevel's "Ġ", Metaspace's or a Replace's "▁") is read the same way."""
  if isinstance(tokenizer.model, models.WordPiece):
    return tokenizer.model.continuing_subword_prefix, None
  tokens = tokenizer.encode("a b", add_special_tokens=False).tokens
  last = tokens[-1] if tokens else ""
  if last.endswith("b") and len(last) > 1:
    return None, last[:-1]
  return None, None

