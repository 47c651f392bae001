"""Sentence segmentation (BERT's NSP pairs and instance boundaries are sentences), by sentencex:
Wikimedia's rule-based segmenter, maintained, nothing to download at run time, and it keeps
abbreviations such as "Dr." and "e.g." inside their sentence.

sentencex splits a code it has no rules for with English rules without a word, so a code is
checked here (`check_language`): its primary subtag, in any case, is what sentencex is given,
and a code without rules of its own (`RULE_LANGUAGES`) is refused.

The guide: docs/data.md, 'Sentences'.
"""

from __future__ import annotations

import functools
import re

import sentencex

# The languages of sentencex's `language_factory` (checked against sentencex 1.0.x, where every
# one of them splits differently from English).
RULE_LANGUAGES = frozenset(
    "am ar bg bn ca da de el en es fi fr gu hi hy it ja kk kn ml mr my nl pa pl pt ru sk ta te "
    "uk".split())
# An ISO 639 code with optional subtags ("pt-br"), once lower-cased.
_CODE = re.compile(r"[a-z]{2,3}(?:-[a-z0-9]{1,8})*")


@functools.cache
def check_language(code: str) -> str:
  """The sentencex language that splits text in language `code`: its primary subtag, read
  case-insensitively ("bg", "BG", "bg_BG", "de-AT" -> "de"), when sentencex has rules for it.
  Raises ValueError naming `code` otherwise, where sentencex would split with English rules
  unannounced: not a code ("", "Bulgarian"), an unknown code ("xx"), or a language without
  rules of its own ("sv"), for which "en" is the explicit choice."""
  normal = code.strip().lower().replace("_", "-") if isinstance(code, str) else ""
  if not _CODE.fullmatch(normal):
    raise ValueError(f"language {code!r}: not a language code; expected an ISO 639 code such "
                     "as 'en', 'bg' or 'pt-br'")
  primary = normal.split("-", 1)[0]
  if primary not in RULE_LANGUAGES:
    raise ValueError(f"language {code!r}: sentencex has no sentence rules for it (it would "
                     "split with English rules unannounced); languages with rules: "
                     f"{' '.join(sorted(RULE_LANGUAGES))}; use 'en' for English rules "
                     "(sentences ending in . ! ?) or the code of a close language")
  return primary


def split_sentences(paragraph: str, language: str = "en") -> list[str]:
  """The sentences of one paragraph, whitespace-trimmed, empty ones dropped. `language` must
  pass `check_language` (ValueError otherwise)."""
  return [s.strip() for s in sentencex.segment(check_language(language), paragraph)
          if s.strip()]
