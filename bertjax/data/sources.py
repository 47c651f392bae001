"""Readers of raw text corpora -> one document type, `TextDocument`, so that every later stage
(sentence splitting, tokenisation, instance building, mixing) is written once.

Kinds (`SOURCE_KINDS`): MediaWiki XML dumps (`wikipedia`), WikiExtractor output
(`wikiextractor`, JSON lines or `<doc>` text), plain-text books (`text`, BooksCorpus style),
google-research/bert's one-sentence-per-line files (`bert_lines`), one document per line
(`lines`, news-crawl style, optionally with an id column), JSON lines (`jsonl`), Parquet
(`parquet`) and TFDS datasets in array_record format (`tfds`, no TensorFlow needed).

Line-oriented kinds read UTF-8 unless the spec says `?encoding=` (any Python codec: latin-1,
cp1251, utf-16, ...); lines the codec cannot decode are skipped and counted.

Every reader is a generator that streams with bounded memory: lines are read from binary
handles with a bounded `readline`, Parquet by record batches, TFDS by index. A document larger
than `max_document_bytes` (only a text file, a bert_lines or a `<doc>` document can be) is cut
at a line boundary into parts "ID", "ID#2", ... rather than held whole. Files are read in
sorted path order, so a source yields the same documents in the same order on every run.

Bad input never disappears silently: input that cannot be used at all raises `CorpusError`
naming the file and the position; anything skipped is counted by reason in `SkipCounts` and
the first few of each reason are logged with file:line. The reasons counted here are:
"empty file", "empty document", "binary file", "invalid UTF-8 line", "line too long",
"malformed JSON line", "missing text field", "missing id field", "unterminated document",
"line outside <doc>", "invalid UTF-8 record", "undecodable line" (a line a non-UTF-8 `encoding`
cannot decode), plus `read_dump`'s own for `wikipedia`.

A binary file (NUL bytes in its first 8 KiB, after decompression) among text files is skipped
and counted "binary file"; when no file of a source holds text and at least one was binary
(e.g. the only path given is a PNG), that is a `CorpusError` instead — surely a wrong path.
Line-oriented files may be gzip or bzip2 compressed (recognised by their magic bytes).
"""

from __future__ import annotations

import bz2
import codecs
import collections
import dataclasses
import glob
import gzip
import html
import io
import json
import logging
import math
import os
import re
import zlib
from pathlib import Path
from typing import IO, Callable, Iterator

from bertjax.data.errors import CorpusError, SkipCounts
from bertjax.data.sentences import check_language
from bertjax.data.wikipedia import EMBEDDED_DUMP, Page, read_dump, read_pages

log = logging.getLogger(__name__)

SOURCE_KINDS = ("wikipedia", "wikiextractor", "text", "bert_lines", "lines", "jsonl", "parquet",
                "tfds")

# A line longer than this is skipped (and counted), never built in memory.
MAX_LINE_BYTES = 1 << 20
# Far above any real book (a long novel is ~2 MB); only a pathological file is cut into parts.
MAX_DOCUMENT_BYTES = 16 << 20
# How much of a file's (decompressed) start is checked for NUL bytes, as git and grep do.
BINARY_PROBE_BYTES = 8192
# Skips of one reason logged per source read; the rest are only counted.
WARNINGS_PER_REASON = 5

_DRAIN_BYTES = 1 << 16  # chunk size when discarding the rest of an over-long line
_PARQUET_BATCH_ROWS = 1024  # pyarrow's default of 65536 rows of text can be gigabytes
_TFDS_BATCH_RECORDS = 256


@dataclasses.dataclass(frozen=True)
class TextDocument:
  """One document of clean text: paragraphs are split into sentences later."""

  id: str  # stable, unique within a source: a wiki page id, "books/foo.txt", "file.jsonl:17"
  paragraphs: tuple[str, ...]
  sentences_given: bool = False  # each paragraph is exactly one sentence (bert_lines)


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
  boundary = r",(?=\s*(?:(?:%s):|embedded\s*(?:$|[@?,])))" % "|".join(SOURCE_KINDS)
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


# --------------------------------------------------------------------------- finding files


def _walk(root: Path, accept: Callable[[str], bool]) -> list[Path]:
  """Regular files under `root` that `accept` names, hidden ones left out (.DS_Store, .git)."""
  found, seen, pending = [], set(), [root]
  while pending:
    folder = pending.pop()
    real = os.path.realpath(folder)
    if real in seen:  # a symlink loop
      continue
    seen.add(real)
    try:
      entries = list(os.scandir(folder))
    except OSError as e:
      raise CorpusError(f"{folder}: directory cannot be read ({e.strerror or e})") from None
    for entry in entries:
      if entry.name.startswith("."):
        continue
      if entry.is_dir():
        pending.append(Path(entry.path))
      elif entry.is_file() and accept(entry.name):  # a FIFO or device would block or never end
        found.append(Path(entry.path))
  return found


def _input_files(path: str | Path, accept: Callable[[str], bool],
                 wanted: str) -> list[tuple[Path, str]]:
  """(file, label) pairs of a file, a directory tree or a glob, sorted by label.

  Labels are paths relative to the parent of the directory given (or of a glob's fixed part),
  "books/foo.txt", or a single file's name: stable wherever the corpus is moved to."""
  text = os.path.expanduser(str(path))
  if glob.has_magic(text):
    fixed = []
    for part in Path(text).parts:
      if glob.has_magic(part):
        break
      fixed.append(part)
    base = Path(*fixed).parent if fixed else Path(".")
    matches = sorted(glob.glob(text, recursive=True))
    if not matches:
      raise CorpusError(f"{text}: no files match this pattern")
    files: list[Path] = []
    for match in map(Path, matches):
      files.extend(_walk(match, accept) if match.is_dir() else [match])
    if not files:
      raise CorpusError(f"{text}: the matching directories hold no {wanted} files")
  else:
    root = Path(text)
    if not root.exists():
      raise CorpusError(f"{root}: no such file or directory")
    if not root.is_dir():
      return [(root, root.name)]
    base = root.parent
    files = _walk(root, accept)
    if not files:
      raise CorpusError(f"{root}: directory holds no {wanted} files")
  labelled = {Path(os.path.relpath(f, base)).as_posix(): f for f in files}
  return [(labelled[label], label) for label in sorted(labelled)]


def _suffixes(*names: str) -> Callable[[str], bool]:
  compressed = tuple(f"{n}{c}" for n in names for c in ("", ".gz", ".bz2"))
  return lambda filename: filename.lower().endswith(compressed)


# --------------------------------------------------------------------------- reading lines


class _Skipper:
  """Counts skips and logs the first few of each reason with their position."""

  def __init__(self, skips: SkipCounts):
    self.skips = skips
    self.seen: collections.Counter = collections.Counter()

  def __call__(self, reason: str, where: str, detail: str = "") -> None:
    self.skips.add(reason)
    self.seen[reason] += 1
    if self.seen[reason] <= WARNINGS_PER_REASON:
      log.warning("%s: %s%s, skipped", where, reason, f" ({detail})" if detail else "")
      if self.seen[reason] == WARNINGS_PER_REASON:
        log.warning("further %r skips of this source are counted but not logged", reason)


def _open_binary(path: Path) -> IO[bytes]:
  """A binary handle on the file's content, gzip and bzip2 decompressed by magic bytes."""
  try:
    with open(path, "rb") as probe:
      magic = probe.read(3)
    if magic[:2] == b"\x1f\x8b":
      return gzip.open(path, "rb")
    if magic == b"BZh":
      return bz2.open(path, "rb")
    return open(path, "rb")
  except OSError as e:
    raise CorpusError(f"{path}: cannot be read ({e.strerror or e})") from None


def _read(stream: IO, size: int, path: Path, line: int, readline: bool = True) -> bytes | str:
  """One bounded read (of a binary or a text stream); a truncated or corrupt archive becomes a
  CorpusError at `line`."""
  try:
    return stream.readline(size) if readline else stream.read(size)
  except EOFError:
    raise CorpusError(f"{path}: compressed data ends early — the archive is truncated (at "
                      f"line {line})") from None
  except (OSError, zlib.error) as e:
    raise CorpusError(f"{path}: cannot be read at line {line} ({e})") from None


def _ascii_compatible(encoding: str) -> bool:
  """Whether the codec writes ASCII as ASCII bytes (latin-1, cp1251, utf-8: lines split on
  b"\\n" and NUL bytes mean binary) rather than in wider units (utf-16, utf-32)."""
  return "a\n".encode(encoding) == b"a\n"


def _text_files(files: list[tuple[Path, str]], skip: _Skipper,
                encoding: str = "utf-8") -> Iterator[tuple[Path, str]]:
  """The files that hold text; empty and binary ones are counted and left out."""
  binary, texts = [], 0
  for path, label in files:
    with _open_binary(path) as stream:
      head = _read(stream, BINARY_PROBE_BYTES, path, 1, readline=False)
    if not head:
      skip("empty file", str(path))
    elif b"\0" in head and _ascii_compatible(encoding):
      utf16 = head[:2] in (b"\xff\xfe", b"\xfe\xff")
      skip("binary file", str(path), "UTF-16 text? read it with ?encoding=utf-16" if utf16
           else f"NUL bytes in its first {BINARY_PROBE_BYTES} bytes")
      binary.append(str(path))
    else:
      texts += 1
      yield path, label
  if binary and not texts:
    raise CorpusError(f"{', '.join(binary[:3])}{' ...' if len(binary) > 3 else ''}: binary, "
                      f"not text (NUL bytes in the first {BINARY_PROBE_BYTES} bytes); no file "
                      f"of this source holds text")


def _lines(path: Path, skip: _Skipper, max_line_bytes: int,
           encoding: str = "utf-8") -> Iterator[tuple[int, str]]:
  """(line number from 1, text without its newline); invalid and over-long lines are skipped."""
  if not _ascii_compatible(encoding):
    yield from _wide_lines(path, skip, max_line_bytes, encoding)
    return
  utf8 = codecs.lookup(encoding).name == "utf-8"
  with _open_binary(path) as stream:
    number = 0
    while True:
      line = _read(stream, max_line_bytes + 1, path, number + 1)
      if not line:
        return
      number += 1
      if len(line) > max_line_bytes and not line.endswith(b"\n"):
        while line and not line.endswith(b"\n"):  # discard the rest in bounded chunks
          line = _read(stream, _DRAIN_BYTES, path, number)
        skip("line too long", f"{path}:{number}", f"over {max_line_bytes} bytes")
        continue
      try:
        text = line.decode(encoding)
      except UnicodeDecodeError as e:
        skip("invalid UTF-8 line" if utf8 else "undecodable line", f"{path}:{number}",
             f"byte {e.start}" if utf8 else f"byte {e.start} is not {encoding}")
        continue
      if number == 1:
        text = text.removeprefix("\ufeff")  # a byte order mark is not text
      yield number, text.rstrip("\r\n")


def _wide_lines(path: Path, skip: _Skipper, max_line_bytes: int,
                encoding: str) -> Iterator[tuple[int, str]]:
  """`_lines` for codecs with multi-byte units (UTF-16/32): decoded incrementally, so lines
  split on decoded newlines; an undecodable stretch makes its line skipped."""
  with _open_binary(path) as raw:
    stream = io.TextIOWrapper(raw, encoding=encoding, errors="replace", newline="")
    number = 0
    # A character is at least one byte: a line of max_line_bytes characters may be longer in
    # bytes, which only loosens the bound by the codec's width.
    while True:
      line = _read(stream, max_line_bytes + 1, path, number + 1)
      if not line:
        return
      number += 1
      if len(line) > max_line_bytes and not line.endswith("\n"):
        while line and not line.endswith("\n"):
          line = _read(stream, _DRAIN_BYTES, path, number)
        skip("line too long", f"{path}:{number}", f"over {max_line_bytes} characters")
        continue
      if "\ufffd" in line:
        skip("undecodable line", f"{path}:{number}", f"not {encoding}")
        continue
      if number == 1:
        line = line.removeprefix("\ufeff")
      yield number, line.rstrip("\r\n")


class _Document:
  """Collects the lines of one document; past `max_bytes` it hands out parts ID, ID#2, ..."""

  def __init__(self, doc_id: str, max_bytes: int, sentences_given: bool = False):
    self.id, self.max_bytes, self.sentences_given = doc_id, max_bytes, sentences_given
    self.paragraphs: list[str] = []
    self.lines: list[str] = []
    self.size = 0
    self.parts = 0

  def add(self, line: str) -> TextDocument | None:
    """Appends a line to the open paragraph; returns a finished part when over budget."""
    self.lines.append(line)
    self.size += len(line) + 1
    if self.size <= self.max_bytes:
      return None
    if self.parts == 0:
      log.info("%s: document over %d bytes, cut into parts", self.id, self.max_bytes)
    return self._part()

  def end_paragraph(self) -> None:
    if self.lines:
      self.paragraphs.append(" ".join(self.lines))
      self.lines = []

  def finish(self) -> TextDocument | None:
    return self._part() if self.lines or self.paragraphs else None

  def _part(self) -> TextDocument:
    self.end_paragraph()
    self.parts += 1
    doc = TextDocument(id=self.id if self.parts == 1 else f"{self.id}#{self.parts}",
                       paragraphs=tuple(self.paragraphs), sentences_given=self.sentences_given)
    self.paragraphs, self.size = [], 0
    return doc


def _finish(doc: _Document, skip: _Skipper, where: str) -> Iterator[TextDocument]:
  last = doc.finish()
  if last is not None:
    yield last
  elif doc.parts == 0:
    skip("empty document", where)


def _paragraphs(text: str) -> tuple[str, ...]:
  return tuple(p for p in (line.strip() for line in text.splitlines()) if p)


# --------------------------------------------------------------------------- readers


def read_wikipedia(path: str | Path, skips: SkipCounts, raw_pages: bool = False,
                   keep_lists: bool = False) -> Iterator[TextDocument | Page]:
  """Articles of MediaWiki XML dumps (a file, plain or .bz2, a directory or glob of dump
  parts); id = page id, paragraphs as `read_dump` cleans them (the title is not one;
  `keep_lists`: list items stay, see `wikitext.clean_wikitext`)."""
  if str(path) == "embedded":
    path = EMBEDDED_DUMP
  skip = _Skipper(skips)
  for file, _ in _input_files(path, lambda name: ".xml" in name.lower(), "MediaWiki dump"):
    try:
      empty = file.stat().st_size == 0
    except OSError as e:
      raise CorpusError(f"{file}: cannot be read ({e.strerror or e})") from None
    if empty:
      skip("empty file", str(file))
      continue
    if raw_pages:
      yield from read_pages(file, skips)
      continue
    for article in read_dump(file, skips, keep_lists=keep_lists):
      yield TextDocument(id=article.id, paragraphs=tuple(article.paragraphs))


def read_wikiextractor(path: str | Path, skips: SkipCounts, *,
                       max_line_bytes: int = MAX_LINE_BYTES, encoding: str = "utf-8",
                       max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[TextDocument]:
  """WikiExtractor output, a file or its AA/wiki_00 tree (optionally .bz2), in either form:
  `--json` lines {"id", "url", "title", "text"}, or `<doc id=.. url=.. title=..>` blocks whose
  first line repeats the title. id = page id; paragraphs = non-empty lines, HTML entities
  unescaped (WikiExtractor escapes &, <, > by default)."""
  skip = _Skipper(skips)
  files = _input_files(path, lambda name: True, "WikiExtractor output")
  for file, label in _text_files(files, skip, encoding):
    doc: _Document | None = None
    doc_line = 0
    json_form: bool | None = None
    for number, line in _lines(file, skip, max_line_bytes, encoding):
      stripped = line.strip()
      if json_form is None:  # the first non-blank line tells the form
        if not stripped:
          continue
        json_form = stripped.startswith("{")
        if not json_form and not stripped.startswith("<doc"):
          raise CorpusError(f"{file}:{number}: not WikiExtractor output (a line starting with "
                            f"'{{' or '<doc' expected, found {stripped[:40]!r})")
      where = f"{file}:{number}"
      if json_form:
        if stripped:
          document = _wikiextractor_json(stripped, where, skip)
          if document is not None:
            yield document
        continue
      if stripped.startswith("<doc ") or stripped == "<doc>":
        if doc is not None:
          skip("unterminated document", f"{file}:{doc_line}", "no </doc> before the next <doc>")
        found = re.search(r'\bid="([^"]*)"', stripped)
        doc = _Document(found.group(1) if found else f"{label}:{number}", max_document_bytes)
        doc_line = number
      elif stripped == "</doc>":
        if doc is None:
          skip("line outside <doc>", where)
          continue
        yield from _finish(doc, skip, f"{file}:{doc_line}")
        doc = None
      elif doc is None:
        if stripped:
          skip("line outside <doc>", where)
      elif number == doc_line + 1:
        continue  # the title, repeated
      elif stripped:
        part = doc.add(html.unescape(stripped))
        doc.end_paragraph()
        if part is not None:
          yield part
    if doc is not None:
      skip("unterminated document", f"{file}:{doc_line}", "the file ends before </doc>")


def _wikiextractor_json(line: str, where: str, skip: _Skipper) -> TextDocument | None:
  record = _json_object(line, where, skip)
  if record is None:
    return None
  text = record.get("text")
  if not isinstance(text, str):
    skip("missing text field", where, "no string 'text'")
    return None
  paragraphs = tuple(html.unescape(p) for p in _paragraphs(text))
  title = str(record.get("title", "")).strip()
  if paragraphs and title and paragraphs[0] == title:  # some versions start the text with it
    paragraphs = paragraphs[1:]
  if not paragraphs:
    skip("empty document", where)
    return None
  return TextDocument(id=str(record.get("id") or where), paragraphs=paragraphs)


def read_text(path: str | Path, skips: SkipCounts, *, max_line_bytes: int = MAX_LINE_BYTES,
              encoding: str = "utf-8",
              max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[TextDocument]:
  """Plain-text books (BooksCorpus style): a file, or a directory tree / glob of .txt files
  (.txt.gz, .txt.bz2 too); one document per file, id = its label ("books/foo.txt");
  paragraphs split on blank lines, the lines of a paragraph joined with a space."""
  skip = _Skipper(skips)
  files = _input_files(path, _suffixes(".txt"), ".txt")
  for file, label in _text_files(files, skip, encoding):
    doc = _Document(label, max_document_bytes)
    for _, line in _lines(file, skip, max_line_bytes, encoding):
      stripped = line.strip()
      if not stripped:
        doc.end_paragraph()
        continue
      part = doc.add(stripped)
      if part is not None:
        yield part
    yield from _finish(doc, skip, str(file))


def read_bert_lines(path: str | Path, skips: SkipCounts, *,
                    max_line_bytes: int = MAX_LINE_BYTES, encoding: str = "utf-8",
                    max_document_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[TextDocument]:
  """google-research/bert's input: one sentence per line, blank lines between documents (a
  file, or a tree / glob of .txt files). id = "label:first line"; sentences_given."""
  skip = _Skipper(skips)
  files = _input_files(path, _suffixes(".txt"), ".txt")
  for file, label in _text_files(files, skip, encoding):
    doc: _Document | None = None
    documents = 0
    for number, line in _lines(file, skip, max_line_bytes, encoding):
      stripped = line.strip()
      if not stripped:
        if doc is not None:
          yield from _finish(doc, skip, f"{file}:{number}")
          documents += 1
          doc = None
        continue
      if doc is None:
        doc = _Document(f"{label}:{number}", max_document_bytes, sentences_given=True)
      part = doc.add(stripped)
      doc.end_paragraph()
      if part is not None:
        yield part
    if doc is not None:
      yield from _finish(doc, skip, str(file))
      documents += 1
    if documents == 0:
      skip("empty document", str(file), "only blank lines")


def read_lines(path: str | Path, skips: SkipCounts, *, id_separator: str = "",
               max_line_bytes: int = MAX_LINE_BYTES, encoding: str = "utf-8"
               ) -> Iterator[TextDocument]:
  """One document per line (news-crawl and most web-text dumps; a file, or a tree / glob of
  .txt, .tsv or .lines files, optionally .gz/.bz2): the line is the document's one paragraph,
  blank lines hold no document. id = "label:line", or with `id_separator` ("\\t" for a TSV
  of id and text) the text before the first separator (a line without one is skipped and
  counted "missing id field")."""
  skip = _Skipper(skips)
  files = _input_files(path, _suffixes(".txt", ".tsv", ".lines"), ".txt/.tsv/.lines")
  for file, label in _text_files(files, skip, encoding):
    for number, line in _lines(file, skip, max_line_bytes, encoding):
      doc_id, text = f"{label}:{number}", line
      if id_separator:
        found, sep, rest = line.partition(id_separator)
        if not sep:
          if line.strip():
            skip("missing id field", f"{file}:{number}", f"no {id_separator!r} separator")
          continue
        doc_id, text = found.strip(), rest
      text = text.strip()
      if not text:
        if id_separator:
          skip("empty document", f"{file}:{number}")
        continue  # a blank line holds no document
      yield TextDocument(id=doc_id or f"{label}:{number}", paragraphs=(text,))


def _json_object(line: str, where: str, skip: _Skipper) -> dict | None:
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    skip("malformed JSON line", where, f"{e.msg} at column {e.colno}")
    return None
  if not isinstance(record, dict):
    skip("malformed JSON line", where, f"a JSON {type(record).__name__}, not an object")
    return None
  return record


def read_jsonl(path: str | Path, skips: SkipCounts, *, text_field: str = "text",
               id_field: str = "", max_line_bytes: int = MAX_LINE_BYTES,
               encoding: str = "utf-8") -> Iterator[TextDocument]:
  """JSON lines (a file, or a tree / glob of .jsonl, .json, .ndjson, optionally .gz/.bz2): one
  document per object; paragraphs = the non-empty lines of `text_field`; id = `id_field`'s
  value, else "label:line"."""
  skip = _Skipper(skips)
  files = _input_files(path, _suffixes(".jsonl", ".json", ".ndjson"), "JSON lines")
  for file, label in _text_files(files, skip, encoding):
    for number, line in _lines(file, skip, max_line_bytes, encoding):
      if not line.strip():
        continue  # a blank line holds no document
      where = f"{file}:{number}"
      record = _json_object(line, where, skip)
      if record is None:
        continue
      doc = _record_document(record.get(text_field), record.get(id_field) if id_field else None,
                             f"{label}:{number}", where, skip, text_field, id_field)
      if doc is not None:
        yield doc


def _record_document(text: object, id_value: object, default_id: str, where: str,
                     skip: _Skipper, text_field: str, id_field: str) -> TextDocument | None:
  """One JSON/Parquet record as a document, or None with the reason counted."""
  if not isinstance(text, str):
    skip("missing text field", where, f"no string {text_field!r}")
    return None
  paragraphs = _paragraphs(text)
  if not paragraphs:
    skip("empty document", where)
    return None
  doc_id = default_id
  if id_field:
    if id_value is None:
      skip("missing id field", where, f"no {id_field!r}; the document is kept as {default_id}")
    else:
      doc_id = str(id_value)
  return TextDocument(id=doc_id, paragraphs=paragraphs)


def read_parquet(path: str | Path, skips: SkipCounts, *, text_field: str = "text",
                 id_field: str = "") -> Iterator[TextDocument]:
  """Parquet files (a file, or a tree / glob of .parquet), streamed by record batches of the
  needed columns only; paragraphs = the non-empty lines of `text_field`; id = `id_field`'s
  value, else "label:row" (rows counted from 0 within each file)."""
  import pyarrow as pa  # only Parquet sources need pyarrow
  import pyarrow.parquet as pq

  skip = _Skipper(skips)
  for file, label in _input_files(path, _suffixes(".parquet"), ".parquet"):
    try:
      if file.stat().st_size == 0:
        skip("empty file", str(file))
        continue
      parquet = pq.ParquetFile(file)
    except (OSError, pa.ArrowException) as e:
      raise CorpusError(f"{file}: not a readable Parquet file ({e})") from None
    schema = parquet.schema_arrow
    columns = [text_field] + ([id_field] if id_field else [])
    for column in columns:
      if column not in schema.names:
        raise CorpusError(f"{file}: no column {column!r}; columns: {', '.join(schema.names)}")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):
      raise CorpusError(f"{file}: column {text_field!r} holds {kind}, not strings")
    row = 0
    try:
      for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns):
        texts = batch.column(0).to_pylist()
        ids = batch.column(1).to_pylist() if id_field else [None] * len(texts)
        for text, value in zip(texts, ids):
          doc = _record_document(text, value, f"{label}:{row}", f"{file}:row {row}", skip,
                                 text_field, id_field)
          row += 1
          if doc is not None:
            yield doc
    except (OSError, pa.ArrowException) as e:
      raise CorpusError(f"{file}: cannot be read at row {row} ({e})") from None


def read_tfds(name: str, skips: SkipCounts, *, split: str = "train", data_dir: str = "",
              text_field: str = "text", id_field: str = "") -> Iterator[TextDocument]:
  """A prepared TFDS dataset in array_record format, through `tfds.data_source` (random
  access, no TensorFlow); nothing is downloaded or built. Paragraphs = the non-empty lines of
  the text feature (bytes decoded as UTF-8); id = `id_field`'s value, else "name:split:index"."""
  import tensorflow_datasets as tfds  # a slow import that only tfds sources need

  where = f"tfds:{name} split {split!r}" + (f" in {data_dir}" if data_dir else "")
  try:
    source = tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
  except Exception as e:  # TFDS raises many types; each means "cannot open"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise CorpusError(f"{where}: cannot be opened ({type(e).__name__}: {first}); a tfds source "
                      f"must be prepared in array_record format, e.g. `tfds build {name} "
                      f"--file_format=array_record`") from None
  features = sorted(source.dataset_info.features.keys())
  for field in [text_field] + ([id_field] if id_field else []):
    if field not in features:
      raise CorpusError(f"{where}: no feature {field!r}; features: {', '.join(features)}")
  skip = _Skipper(skips)
  total = len(source)
  for start in range(0, total, _TFDS_BATCH_RECORDS):
    indices = range(start, min(start + _TFDS_BATCH_RECORDS, total))
    try:
      records = (source.__getitems__(list(indices)) if hasattr(source, "__getitems__")
                 else [source[i] for i in indices])
    except Exception as e:  # array_record and the decoders raise many types
      raise CorpusError(f"{where}: cannot read records {indices.start}..{indices.stop - 1} "
                        f"({type(e).__name__}: {e})") from None
    for index, record in zip(indices, records):
      position = f"{where} record {index}"
      text = _tfds_text(record[text_field], text_field, position, skip)
      if text is None:
        continue
      paragraphs = _paragraphs(text)
      if not paragraphs:
        skip("empty document", position)
        continue
      doc_id = f"{name}:{split}:{index}"
      if id_field:
        value = _tfds_text(record[id_field], id_field, position, skip)
        doc_id = doc_id if value is None else value
      yield TextDocument(id=doc_id, paragraphs=paragraphs)


def _tfds_text(value: object, field: str, position: str, skip: _Skipper) -> str | None:
  if isinstance(value, str):
    return value
  if not isinstance(value, bytes):  # np.bytes_ is bytes
    raise CorpusError(f"{position}: feature {field!r} holds {type(value).__name__}, not text")
  try:
    return value.decode("utf-8")
  except UnicodeDecodeError as e:
    skip("invalid UTF-8 record", position, f"feature {field!r}, byte {e.start}")
    return None
