"""Streaming reader of MediaWiki XML dumps (`*-pages-articles*.xml`, plain or .bz2, multistream
or not) -> articles of clean prose, in constant memory (`iterparse`, each page cleared after
use); what is skipped and what is an error: docs/data.md, 'MediaWiki dumps → articles'.

`read_pages` is the reading half alone (raw wikitext of the pages kept), so that a build can
clean pages (`clean_page`, the costly half) in worker processes; `read_dump` chains the two.
`read_stream_pages` reads the pages of a byte range of a bz2 multistream dump (whole streams:
`multistream.owned_ranges`) with exactly `read_pages`'s filtering and skip counts.
"""

from __future__ import annotations

import bz2
import dataclasses
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import IO, NamedTuple
from xml.parsers import expat

from bertjax import paths
from bertjax.data.errors import CorpusError, SkipCounts
from bertjax.data.multistream import is_stream_header
from bertjax.data.wikitext import clean_wikitext, is_disambiguation

# Where the embedded default corpus lives (package data), with its attribution.
EMBEDDED_DUMP = Path(__file__).parent / "corpora" / "enwiki-sample-pages-articles.xml.bz2"


@dataclasses.dataclass(frozen=True)
class Article:
  id: str
  title: str
  paragraphs: list[str]


class Page(NamedTuple):
  """A main-namespace page that is neither a redirect nor a disambiguation page, uncleaned (a
  tuple: cheap to send to a worker process)."""
  id: str
  title: str
  wikitext: str


def clean_page(page: Page, keep_lists: bool = False) -> Article | None:
  """The page's article of clean prose; None when no paragraph is left (an "empty article").
  `keep_lists`: list items are kept as prose (see `clean_wikitext`)."""
  paragraphs = clean_wikitext(page.wikitext, keep_lists=keep_lists)
  if not paragraphs:
    return None
  return Article(id=page.id, title=page.title, paragraphs=paragraphs)


def _open(path: Path) -> IO[bytes]:
  if not path.exists():
    raise CorpusError(f"{path}: no such file")
  if path.is_dir():
    raise CorpusError(f"{path}: is a directory, not a MediaWiki XML dump")
  try:
    with open(path, "rb") as probe:
      magic = probe.read(3)
  except OSError as e:
    raise CorpusError(f"{path}: cannot be read ({e.strerror})") from None
  if not magic:
    raise CorpusError(f"{path}: empty file")
  if magic == b"BZh":
    return bz2.open(path, "rb")  # reads every stream of a multistream archive in turn
  return open(path, "rb")


def _local(tag: str) -> str:
  return tag.rsplit("}", 1)[-1]


def read_dump(path: str | Path, skips: SkipCounts | None = None,
              keep_lists: bool = False) -> Iterator[Article]:
  """Articles of the main namespace, in dump order, with clean paragraphs (list items kept as
  prose if `keep_lists`)."""
  skips = SkipCounts() if skips is None else skips
  for page in read_pages(path, skips):
    article = clean_page(page, keep_lists=keep_lists)
    if article is None:
      skips.add("empty article")
    else:
      yield article


def read_pages(path: str | Path, skips: SkipCounts | None = None) -> Iterator[Page]:
  """Pages of the main namespace, in dump order, with their raw wikitext; redirects,
  disambiguation pages and other namespaces are skipped and counted in `skips`."""
  path = Path(path)
  skips = SkipCounts() if skips is None else skips
  stream = _open(path)
  pages = 0
  try:
    context = ET.iterparse(stream, events=("start", "end"))
    root = None
    for event, element in context:
      if root is None:
        root = element
        if _local(root.tag) != "mediawiki":
          raise CorpusError(f"{path}: not a MediaWiki export (root element <{_local(root.tag)}>)")
      if event != "end" or _local(element.tag) != "page":
        continue
      pages += 1
      page = _page(element, skips)
      if page is not None:
        yield page
      root.clear()  # constant memory: drop the finished page from the tree
  except ET.ParseError as e:
    line, column = e.position
    raise CorpusError(f"{path}: malformed XML at line {line}, column {column} (after {pages} "
                      f"complete pages): {e}") from None
  except EOFError:
    raise CorpusError(f"{path}: compressed data ends early — the archive is truncated (after "
                      f"{pages} complete pages)") from None
  except OSError as e:
    raise CorpusError(f"{path}: cannot be decompressed after {pages} complete pages ({e})") \
        from None
  finally:
    stream.close()
  if pages == 0:
    skips.add("empty dump")


# Compressed bytes per read, and decompressed bytes per parser feed (bounded: a bz2 block can
# expand a great deal).
_READ_BYTES = 1 << 20
_FEED_BYTES = 1 << 20


def read_stream_pages(path: str | Path, start: int, end: int, skips: SkipCounts | None = None,
                      read_log: list[tuple[int, int]] | None = None,
                      encoding: str = "utf-8") -> Iterator[Page]:
  """The pages held by the bz2 streams that tile the bytes [start, end) of a multistream dump
  (one or several whole streams: `multistream.owned_ranges`), filtered and counted in `skips`
  exactly as `read_pages` does, so that the ranges of a dump read in order give `read_pages`'s
  pages and skips. Reads only those bytes (appending (start, end reached) to `read_log`), in
  constant memory. The range at byte 0 holds the header stream, whose XML declaration sets the
  encoding; any other range is read as `encoding` (dumps are UTF-8). Corrupt or truncated data,
  or a range that does not begin and end at stream boundaries, is a `CorpusError` naming the
  file and the stream's byte offset. (No range sees a whole dump: a dump without pages is not
  counted as an "empty dump" here.)"""
  path = paths.path(path)
  skips = SkipCounts() if skips is None else skips
  if not 0 <= start <= end:
    raise ValueError(f"not a byte range: [{start}, {end})")
  if start == end:
    return
  try:
    file = paths.open_binary(path)
  except FileNotFoundError:
    raise CorpusError(f"{path}: no such file") from None
  except OSError as e:
    raise CorpusError(f"{path}: cannot be read ({e.strerror})") from None
  where = {"stream": start, "reached": start}  # for error messages and read_log
  parser = ET.XMLPullParser(events=("start", "end"))
  if start > 0:
    # A fragment of pages: the <mediawiki> root it lacks is supplied (and closed below), so the
    # pages are children of a root as in a whole dump. The namespace does not matter: `_local`.
    parser.feed(f'<?xml version="1.0" encoding="{encoding}"?><mediawiki>'.encode("ascii"))
  root = None
  open_tags: list[str] = []
  try:
    for stream, text in _decompressed(file, path, start, end, where):
      parser.feed(text)
      for event, element in parser.read_events():
        if event == "start":
          if root is None:
            root = element
            if _local(root.tag) != "mediawiki":
              raise CorpusError(f"{path}: not a MediaWiki export (root element "
                                f"<{_local(root.tag)}> in the bz2 stream at byte {stream})")
          open_tags.append(element.tag)
          continue
        open_tags.pop()
        if _local(element.tag) != "page":
          continue
        page = _page(element, skips)
        if page is not None:
          yield page
        root.clear()  # constant memory: drop the finished page from the tree
    if len(open_tags) > 1:
      raise CorpusError(f"{path}: the bz2 streams in bytes [{start}, {end}) end inside "
                        f"<{_local(open_tags[-1])}>: streams that do not hold whole pages")
    if open_tags:  # the root, opened above or by the header stream, closed elsewhere
      parser.feed(b"</mediawiki>")
    parser.close()
    for _ in parser.read_events():
      pass
  except ET.ParseError as e:
    raise CorpusError(f"{path}: malformed XML in the bz2 stream at byte {where['stream']} "
                      f"(range [{start}, {end})): {expat.ErrorString(e.code)}") from None
  finally:
    file.close()
    if read_log is not None:
      read_log.append((start, where["reached"]))


def _decompressed(file: IO[bytes], path: Path, start: int, end: int,
                  where: dict) -> Iterator[tuple[int, bytes]]:
  """(offset of its stream, decompressed bytes) of the bz2 streams tiling [start, end), in
  pieces of at most _FEED_BYTES; where["stream"] is the stream being read, where["reached"] the
  next byte to read."""
  file.seek(start)
  pos = start
  stream = start
  decompressor = bz2.BZ2Decompressor()
  fresh = True  # `decompressor` has had no input yet
  data = b""
  while True:
    if not data and (fresh or decompressor.needs_input):
      if pos == end:
        break
      data = file.read(min(_READ_BYTES, end - pos))
      if not data:
        raise CorpusError(f"{path}: the file ends at byte {pos}, inside the range "
                          f"[{start}, {end}) (truncated?)")
      pos += len(data)
      where["reached"] = pos
    try:
      text = decompressor.decompress(data, _FEED_BYTES)
    except OSError as e:
      file.seek(stream)
      problem = (f"the bz2 stream at byte {stream} is corrupt" if is_stream_header(file.read(10))
                 else f"byte {stream} does not start a bz2 stream (a wrong offset or index?)")
      raise CorpusError(f"{path}: {problem} ({e}; range [{start}, {end}))") from None
    data = b""
    fresh = False
    if text:
      yield stream, text
    if decompressor.eof:
      data = decompressor.unused_data
      stream = pos - len(data)
      where["stream"] = stream
      decompressor = bz2.BZ2Decompressor()
      fresh = True
  if not fresh:
    raise CorpusError(f"{path}: the bz2 stream at byte {stream} does not end by byte {end} (a "
                      f"truncated dump, or a range end that is not a stream start)")


def _page(page: ET.Element, skips: SkipCounts) -> Page | None:
  fields = {_local(child.tag): child for child in page}
  title = (fields["title"].text or "") if "title" in fields else ""
  if "ns" in fields and (fields["ns"].text or "").strip() != "0":
    skips.add("non-article namespace")
    return None
  if "redirect" in fields:
    skips.add("redirect")
    return None
  revision = fields.get("revision")
  text_node = None if revision is None else next(
      (c for c in revision if _local(c.tag) == "text"), None)
  wikitext = "" if text_node is None else (text_node.text or "")
  if wikitext.lstrip().lower().startswith("#redirect"):
    skips.add("redirect")
    return None
  if is_disambiguation(wikitext, title):
    skips.add("disambiguation")
    return None
  return Page(id=(fields["id"].text or "").strip() if "id" in fields else "", title=title,
              wikitext=wikitext)
