"""The readers of each source kind (`read_wikipedia`, `read_wikiextractor`, `read_text`,
`read_bert_lines`, `read_lines`, `read_jsonl`, `read_parquet`, `read_tfds`) -> one document type,
`TextDocument`; `sources.read_source` picks the reader of a spec's kind. Guide: docs/data.md,
'Sources'.

Every reader is a generator with bounded memory (lines by a bounded `readline`,
bertjax.data.corpus_files; Parquet by record batch; TFDS by index; a document over
`max_document_bytes` cut at a line boundary into parts "ID", "ID#2", ...). Files are read in
sorted path order, so a source yields the same documents in the same order on every run. Bad
input never disappears silently: unusable input raises `CorpusError` naming the file and the
position, and skips are counted by reason in `SkipCounts`, the first few logged with file:line.
"""

from __future__ import annotations

import dataclasses
import html
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

from bertjax.data.corpus_files import (
  MAX_LINE_BYTES,
  Skipper,
  input_files,
  suffixes,
  text_files,
  text_lines,
)
from bertjax.data.errors import CorpusError, SkipCounts
from bertjax.data.wikipedia import EMBEDDED_DUMP, Page, read_dump, read_pages

log = logging.getLogger(__name__)

# Far above any real book (a long novel is ~2 MB); only a pathological file is cut into parts.
MAX_DOCUMENT_BYTES = 16 << 20
_PARQUET_BATCH_ROWS = 1024  # pyarrow's default of 65536 rows of text can be gigabytes
_TFDS_BATCH_RECORDS = 256


@dataclasses.dataclass(frozen=True)
class TextDocument:
  """One document of clean text: paragraphs are split into sentences later."""

  id: str  # stable, unique within a source: a wiki page id, "books/foo.txt", "file.jsonl:17"
  paragraphs: tuple[str, ...]
  sentences_given: bool = False  # each paragraph is exactly one sentence (bert_lines)


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


def _finish(doc: _Document, skip: Skipper, where: str) -> Iterator[TextDocument]:
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
  skip = Skipper(skips)
  for file, _ in input_files(path, lambda name: ".xml" in name.lower(), "MediaWiki dump"):
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
  skip = Skipper(skips)
  files = input_files(path, lambda name: True, "WikiExtractor output")
  for file, label in text_files(files, skip, encoding):
    doc: _Document | None = None
    doc_line = 0
    json_form: bool | None = None
    for number, line in text_lines(file, skip, max_line_bytes, encoding):
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


def _wikiextractor_json(line: str, where: str, skip: Skipper) -> TextDocument | None:
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
  skip = Skipper(skips)
  files = input_files(path, suffixes(".txt"), ".txt")
  for file, label in text_files(files, skip, encoding):
    doc = _Document(label, max_document_bytes)
    for _, line in text_lines(file, skip, max_line_bytes, encoding):
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
  skip = Skipper(skips)
  files = input_files(path, suffixes(".txt"), ".txt")
  for file, label in text_files(files, skip, encoding):
    doc: _Document | None = None
    documents = 0
    for number, line in text_lines(file, skip, max_line_bytes, encoding):
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
  skip = Skipper(skips)
  files = input_files(path, suffixes(".txt", ".tsv", ".lines"), ".txt/.tsv/.lines")
  for file, label in text_files(files, skip, encoding):
    for number, line in text_lines(file, skip, max_line_bytes, encoding):
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


def _json_object(line: str, where: str, skip: Skipper) -> dict | None:
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
  skip = Skipper(skips)
  files = input_files(path, suffixes(".jsonl", ".json", ".ndjson"), "JSON lines")
  for file, label in text_files(files, skip, encoding):
    for number, line in text_lines(file, skip, max_line_bytes, encoding):
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
                     skip: Skipper, text_field: str, id_field: str) -> TextDocument | None:
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
  import pyarrow as pa  # noqa: PLC0415 - only Parquet sources need pyarrow
  import pyarrow.parquet as pq  # noqa: PLC0415 - as above

  skip = Skipper(skips)
  for file, label in input_files(path, suffixes(".parquet"), ".parquet"):
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
  import tensorflow_datasets as tfds  # noqa: PLC0415 - slow; only tfds sources need it

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
  skip = Skipper(skips)
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


def _tfds_text(value: object, field: str, position: str, skip: Skipper) -> str | None:
  if isinstance(value, str):
    return value
  if not isinstance(value, bytes):  # np.bytes_ is bytes
    raise CorpusError(f"{position}: feature {field!r} holds {type(value).__name__}, not text")
  try:
    return value.decode("utf-8")
  except UnicodeDecodeError as e:
    skip("invalid UTF-8 record", position, f"feature {field!r}, byte {e.start}")
    return None
