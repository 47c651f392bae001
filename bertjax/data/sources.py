"""Corpus sources: where a corpus is and how to read it (`SourceSpec`), its command-line form
`KIND:PATH[@WEIGHT][?key=value&...]` (`parse_source`, `parse_sources`, `format_source`), and
`read_source`, which hands a spec to the reader of its kind (bertjax.data.readers). Every kind
(`SOURCE_KINDS`) reads into one document type, `TextDocument`, so that every later stage
(sentence splitting, tokenisation, instance building, mixing) is written once. The kinds and
their options: docs/data.md, 'Sources'.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import math
import re
from collections.abc import Iterator
from pathlib import Path

from bertjax.data.corpus_files import MAX_LINE_BYTES
from bertjax.data.errors import SkipCounts
from bertjax.data.readers import (
  TextDocument,
  read_bert_lines,
  read_jsonl,
  read_lines,
  read_parquet,
  read_text,
  read_tfds,
  read_wikiextractor,
  read_wikipedia,
)
from bertjax.data.sentences import check_language
from bertjax.data.wikipedia import Page

SOURCE_KINDS = ("wikipedia", "wikiextractor", "text", "bert_lines", "lines", "jsonl", "parquet",
                "tfds")

# Spec fields that only some kinds read; any other non-default value is a mistake in the spec.
_LINE_OPTIONS = ("max_line_bytes", "encoding")
_KIND_OPTIONS = {
    "wikipedia": ("keep_lists",),
    "wikiextractor": _LINE_OPTIONS,
    "text": _LINE_OPTIONS,
    "bert_lines": _LINE_OPTIONS,
    "lines": _LINE_OPTIONS + ("id_separator",),
    "jsonl": ("text_field", "id_field") + _LINE_OPTIONS,
    "parquet": ("text_field", "id_field"),
    "tfds": ("text_field", "id_field", "split", "data_dir"),
}
# Options every kind takes.
_COMMON_KEYS = ("weight", "name", "language")
_KIND_SPECIFIC_KEYS = ("text_field", "id_field", "split", "data_dir", "max_line_bytes",
                       "encoding", "id_separator", "keep_lists")
_QUERY_KEYS = _COMMON_KEYS + _KIND_SPECIFIC_KEYS
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  """Where one corpus is and how to read it; `parse_source` reads the command-line form."""

  kind: str  # one of SOURCE_KINDS
  path: str  # file, directory, glob; tfds: dataset name; wikipedia: "embedded" = EMBEDDED_DUMP
  # Mixing weight (used by the loader); None = unstated: sources mix by their sizes, so an
  # epoch holds every document once (docs/data.md, "Mixtures").
  weight: float | None = None
  text_field: str = "text"  # jsonl, parquet, tfds
  id_field: str = ""  # jsonl, parquet, tfds; "" = ids from the position
  split: str = "train"  # tfds
  data_dir: str = ""  # tfds; "" = TFDS's default
  name: str = ""  # short name for summaries; "" = derived from kind and path
  max_line_bytes: int = MAX_LINE_BYTES  # line-oriented kinds
  encoding: str = "utf-8"  # line-oriented kinds: the files' text encoding (a Python codec)
  # lines: the separator between an id column and the text ("tab" = a tab); "" = no id column,
  # ids from the position.
  id_separator: str = ""
  # wikipedia: keep list items and ':'-indented quotations as paragraphs (dropped by default,
  # as most of them are navigation and fragments).
  keep_lists: bool = False
  # Sentence-splitting language of this source (an ISO code sentencex knows); "" = the build's
  # --language.
  language: str = ""

  def __post_init__(self):
    if self.kind not in SOURCE_KINDS:
      raise ValueError(f"unknown source kind {self.kind!r}; kinds: {', '.join(SOURCE_KINDS)}")
    if not self.path:
      raise ValueError(f"{self.kind} source without a path")
    if self.weight is not None and not (math.isfinite(self.weight) and self.weight > 0):
      raise ValueError(f"source {self.kind}:{self.path}: weight must be positive, got "
                       f"{self.weight}")
    if self.max_line_bytes < 1:
      raise ValueError(f"source {self.kind}:{self.path}: max_line_bytes must be positive")
    try:
      codecs.lookup(self.encoding)
    except LookupError:
      raise ValueError(f"source {self.kind}:{self.path}: unknown encoding {self.encoding!r} "
                       "(a Python codec name such as utf-8, latin-1, cp1251, utf-16)") from None
    if self.language:  # refused now, not at the first paragraph inside a build worker
      object.__setattr__(self, "language", check_language(self.language))
    if self.id_separator == "tab":
      object.__setattr__(self, "id_separator", "\t")
    defaults = SourceSpec.__dataclass_fields__
    for field in _KIND_SPECIFIC_KEYS:
      if getattr(self, field) != defaults[field].default and field not in _KIND_OPTIONS[self.kind]:
        raise ValueError(f"source {self.kind}:{self.path}: option {field} does not apply to "
                         f"{self.kind} sources (they take: "
                         f"{', '.join(_KIND_OPTIONS[self.kind]) or 'no options'})")
    if not self.name:
      object.__setattr__(self, "name", _default_name(self.kind, self.path))


def _default_name(kind: str, path: str) -> str:
  if kind == "tfds" or (kind == "wikipedia" and path == "embedded"):
    return path
  parts = Path(path.rstrip("/")).parts or (path,)
  if glob.has_magic(parts[-1]) and len(parts) > 1:
    return "/".join(parts[-2:])  # "c4/*.jsonl" says more than "*.jsonl"
  return parts[-1]


def parse_source(text: str) -> SourceSpec:
  """`KIND:PATH[@WEIGHT][?key=value&...]`, e.g. "text:/books@0.25",
  "jsonl:/x/*.jsonl?text_field=content", "tfds:wikipedia/20230601.en?split=train",
  "lines:/news/*.txt.gz?id_separator=tab&encoding=latin-1&language=de";
  "embedded" (or "wikipedia:embedded") is the embedded Wikipedia sample.

  The options start at the first "?" followed by `word=` (so "?" stays usable as a glob
  wildcard, "doc?.jsonl"); an option this reader does not know is an error naming it."""
  text = text.strip()
  kind, sep, rest = text.partition(":")
  if not sep and re.match(r"embedded(?:$|[@?])", text):
    kind, rest = "wikipedia", text
  elif not sep or kind not in SOURCE_KINDS:
    raise ValueError(f"source {text!r}: expected KIND:PATH[@WEIGHT][?key=value&...] with KIND "
                     f"one of {', '.join(SOURCE_KINDS)} (or 'embedded')")
  options: dict[str, str] = {}
  query = re.search(r"\?(?=[A-Za-z_][A-Za-z0-9_]*=)", rest)
  if query:
    rest, query_text = rest[:query.start()], rest[query.end():]
    for item in query_text.split("&"):
      key, eq, value = item.partition("=")
      if not eq:
        raise ValueError(f"source {text!r}: bad option {item!r} (expected key=value); "
                         f"options: {', '.join(_QUERY_KEYS)}")
      if key not in _QUERY_KEYS:
        raise ValueError(f"source {text!r}: unknown option {key!r}; options: "
                         f"{', '.join(_QUERY_KEYS)}")
      if key in options:
        raise ValueError(f"source {text!r}: option {key} given twice")
      options[key] = value
  weight = re.fullmatch(r"(.*)@([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)", rest)
  if weight:
    if "weight" in options:
      raise ValueError(f"source {text!r}: weight given twice")
    rest, options["weight"] = weight.group(1), weight.group(2)
  fields: dict[str, object] = dict(options)
  try:
    if "weight" in options:
      fields["weight"] = float(options["weight"])
    if "max_line_bytes" in options:
      fields["max_line_bytes"] = int(options["max_line_bytes"])
  except ValueError:
    raise ValueError(f"source {text!r}: weight must be a number and max_line_bytes an "
                     f"integer") from None
  if "keep_lists" in options:
    if options["keep_lists"].lower() not in _BOOLEANS:
      raise ValueError(f"source {text!r}: keep_lists must be true or false")
    fields["keep_lists"] = _BOOLEANS[options["keep_lists"].lower()]
  return SourceSpec(kind=kind, path=rest, **fields)


def parse_sources(text: str | list[str]) -> list[SourceSpec]:
  """Source specs from a comma-separated string ("wikipedia:/d/enwiki.xml.bz2@0.75,text:/books")
  or a list of them (repeated --source flags). A comma starts a new spec only where a `KIND:`
  (or `embedded`) follows, so paths may hold commas."""
  kinds = "|".join(SOURCE_KINDS)
  boundary = rf",(?=\s*(?:(?:{kinds}):|embedded\s*(?:$|[@?,])))"
  items = [part for item in ([text] if isinstance(text, str) else text)
           for part in re.split(boundary, item)]
  specs = [parse_source(item.strip()) for item in items if item.strip()]
  if not specs:
    raise ValueError("no sources given; e.g. --source embedded (data.sources=embedded)")
  return specs


def format_source(spec: SourceSpec) -> str:
  """The `parse_source` form of a spec: `parse_source(format_source(s)) == s`."""
  text = f"{spec.kind}:{spec.path}"
  if spec.weight is not None:
    text += f"@{spec.weight!r}"
  defaults = SourceSpec.__dataclass_fields__
  shown = {"id_separator": "tab" if spec.id_separator == "\t" else spec.id_separator,
           "keep_lists": str(spec.keep_lists).lower()}
  options = [f"{key}={shown.get(key, getattr(spec, key))}" for key in _QUERY_KEYS
             if key not in ("weight", "name") and getattr(spec, key) != defaults[key].default]
  if spec.name != _default_name(spec.kind, spec.path):
    options.append(f"name={spec.name}")
  return text + ("?" + "&".join(options) if options else "")


def read_source(spec: SourceSpec, skips: SkipCounts,
                raw_pages: bool = False) -> Iterator[TextDocument | Page]:
  """The documents of one source, in a deterministic order. `raw_pages`: a MediaWiki source
  yields uncleaned `wikipedia.Page`s instead (a build cleans them in its worker processes,
  and only those of its own shards); other kinds ignore it."""
  lines = {"max_line_bytes": spec.max_line_bytes, "encoding": spec.encoding}
  if spec.kind == "wikipedia":
    return read_wikipedia(spec.path, skips, raw_pages=raw_pages, keep_lists=spec.keep_lists)
  if spec.kind == "wikiextractor":
    return read_wikiextractor(spec.path, skips, **lines)
  if spec.kind == "text":
    return read_text(spec.path, skips, **lines)
  if spec.kind == "bert_lines":
    return read_bert_lines(spec.path, skips, **lines)
  if spec.kind == "lines":
    return read_lines(spec.path, skips, id_separator=spec.id_separator, **lines)
  if spec.kind == "jsonl":
    return read_jsonl(spec.path, skips, text_field=spec.text_field, id_field=spec.id_field,
                      **lines)
  if spec.kind == "parquet":
    return read_parquet(spec.path, skips, text_field=spec.text_field, id_field=spec.id_field)
  if spec.kind == "tfds":
    return read_tfds(spec.path, skips, split=spec.split, data_dir=spec.data_dir,
                     text_field=spec.text_field, id_field=spec.id_field)
  raise ValueError(f"unknown source kind {spec.kind!r}; kinds: {', '.join(SOURCE_KINDS)}")
