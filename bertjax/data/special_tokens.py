"""The special tokens every tokenizer kind shares (SentencePiece's, a published checkpoint's
tokenizer.json): their bertjax names, the style a set of them fits, and the id properties.

The guide: docs/data.md, 'SentencePiece tokenizers' and 'Hugging Face tokenizers'.
"""

from __future__ import annotations

EOT_TOKEN = "<|endoftext|>"
# The names of the special tokens a tokenizer may have, in the order special_ids lists them.
SPECIAL_NAMES = ("pad", "unk", "cls", "sep", "mask", "eot", "bos", "eos")


def sentinel_piece(index: int) -> str:
  """T5's sentinel `index`: <extra_id_0>, <extra_id_1>, ..."""
  return f"<extra_id_{index}>"


def style_of(special: dict[str, int | None], first_sentinel: int | None) -> str | None:
  """The bertjax style ("bert", "gpt", "t5", "bart") a loaded tokenizer's special tokens fit
  (name -> id, None where absent), or None: bert with [PAD] [CLS] [SEP] [MASK], gpt with an
  end-of-text token, t5 with </s> and the sentinels, bart with <s> </s> <mask>."""
  if all(special.get(n) is not None for n in ("pad", "cls", "sep", "mask")):
    return "bert"
  if special.get("eot") is not None:
    return "gpt"
  if special.get("eos") is not None and first_sentinel is not None:
    return "t5"
  if all(special.get(n) is not None for n in ("bos", "eos", "mask")):
    return "bart"
  return None


def _special_id(name: str) -> property:
  return property(lambda self: self._special[name], doc=f"The {name} token's id, or None.")


class SpecialIds:
  """Special-token ids as properties (None where the tokenizer has no such token), from
  `self._special` (SPECIAL_NAMES -> id), for the tokenizers that are not WordPiece."""

  _special: dict[str, int | None]

  pad_id = _special_id("pad")
  unk_id = _special_id("unk")
  cls_id = _special_id("cls")
  sep_id = _special_id("sep")
  mask_id = _special_id("mask")
  eot_id = _special_id("eot")
