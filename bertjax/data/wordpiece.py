"""WordPiece vocabularies (original BERT / Hugging Face `vocab.txt`), with the ids of Hugging
Face's BertTokenizer, so imported checkpoints can be continued.

Tokenisation itself is Hugging Face `tokenizers` (Rust): BERT's basic tokenizer (cleanup,
CJK spacing, optional lower-casing with accent stripping, punctuation splitting) followed by
greedy longest-match WordPiece. tests/test_wordpiece.py checks its ids against the
`transformers` BertTokenizer on thousands of sentences, cased and uncased.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from tokenizers import BertWordPieceTokenizer

from bertjax.data.errors import CorpusError

BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# transformers' `clean_up_tokenization` (PreTrainedTokenizerBase), in its order.
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


@dataclasses.dataclass
class WordPiece:
  """A loaded vocab.txt: `encode` text to ids; special-token ids by name."""

  path: Path
  lowercase: bool
  _tokenizer: BertWordPieceTokenizer
  vocab: dict[str, int]

  @classmethod
  def from_vocab(cls, path: str | Path, lowercase: bool = True) -> WordPiece:
    """Loads `vocab.txt` (one token per line, id = line number); `lowercase` as the
    checkpoint was trained (bert-base-uncased: True, -cased: False)."""
    path = Path(path)
    if not path.is_file():
      raise CorpusError(f"{path}: no such vocabulary file")
    try:
      lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
      raise CorpusError(f"{path}: not UTF-8 text at byte {e.start}; a vocab.txt is UTF-8, one "
                        "token per line") from None
    if lines and lines[-1] == "":
      lines = lines[:-1]
    vocab = {}
    for i, token in enumerate(lines):
      vocab.setdefault(token.rstrip("\r"), i)
    missing = [t for t in BERT_SPECIAL_TOKENS if t not in vocab]
    if missing:
      raise CorpusError(f"{path}: vocabulary lacks the special token(s) {', '.join(missing)} "
                        f"that BERT needs ({len(vocab)} tokens read)")
    tokenizer = BertWordPieceTokenizer(str(path), lowercase=lowercase,
                                       strip_accents=lowercase, clean_text=True,
                                       handle_chinese_chars=True)
    return cls(path, lowercase, tokenizer, vocab)

  def __len__(self) -> int:
    return len(self.vocab)

  def token_id(self, token: str) -> int:
    return self.vocab[token]

  def encode(self, text: str) -> list[int]:
    """Ids of `text` without [CLS]/[SEP] (instances add those)."""
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

  def to_str(self) -> str:
    """The `tokenizers` pipeline as JSON (a tokenizer.json), casing and accent stripping as
    loaded: what a Hugging Face export carries so that `transformers` encodes alike."""
    return self._tokenizer.to_str()

  def tokens(self, text: str) -> list[str]:
    """The pieces of `text` ("##" marks a continuation), no special tokens added: transformers'
    `BertTokenizer.tokenize`."""
    return self._tokenizer.encode(text, add_special_tokens=False).tokens

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
             clean_up_tokenization_spaces: bool = False) -> str:
    """Text of `ids`, as transformers' `BertTokenizer.decode` gives it: pieces joined by
    spaces, "##" pieces glued to the one before, no space before . , ! ? (the `tokenizers`
    WordPiece decoder's own clean-up), lower-cased and accent-stripped as encoding left it.
    `skip_special_tokens` leaves out [PAD] [UNK] [CLS] [SEP] [MASK]; ids outside the
    vocabulary are left out, as transformers leaves them. `clean_up_tokenization_spaces`:
    transformers' further clean-up ("didn ' t" -> "didn't", but also "x ' y" -> "x'y"), off
    by default for BERT in transformers 5, on where a tokenizer_config.json asks for it (as
    bertjax's Hugging Face export does)."""
    text = self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
    if clean_up_tokenization_spaces:
      for before, after in _CLEAN_UP:
        text = text.replace(before, after)
    return text

  def is_continuation(self, token_id: int) -> bool:
    """True for "##" pieces, which whole-word masking groups with the previous piece."""
    return self._tokenizer.id_to_token(token_id).startswith("##")
