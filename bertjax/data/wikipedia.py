"""Streaming reader of MediaWiki XML dumps (`*-pages-articles*.xml`, plain or .bz2, multistream
or not) -> articles of clean prose.

Constant memory: pages are parsed one at a time with `iterparse` and cleared after use. The
XML declaration's encoding is honoured (the parser reads bytes). Redirects, disambiguation
pages and pages outside the main namespace are skipped and counted; a truncated archive or
malformed XML raises `CorpusError` naming the file and the position reached.
"""

from __future__ import annotations

import bz2
import dataclasses
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import IO, Iterator

from bertjax.data.errors import CorpusError, SkipCounts
from bertjax.data.wikitext import clean_wikitext, is_disambiguation

# Where the embedded default corpus lives (package data), with its attribution.
EMBEDDED_DUMP = Path(__file__).parent / "corpora" / "enwiki-sample-pages-articles.xml.bz2"


@dataclasses.dataclass(frozen=True)
class Article:
  id: str
  title: str
  paragraphs: list[str]


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


def read_dump(path: str | Path, skips: SkipCounts | None = None) -> Iterator[Article]:
  """Articles of the main namespace, in dump order, with clean paragraphs."""
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
      article = _page(element, skips)
      if article is not None:
        yield article
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


def _page(page: ET.Element, skips: SkipCounts) -> Article | None:
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
  paragraphs = clean_wikitext(wikitext)
  if not paragraphs:
    skips.add("empty article")
    return None
  return Article(id=(fields["id"].text or "").strip() if "id" in fields else "", title=title,
                 paragraphs=paragraphs)
