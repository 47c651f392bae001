"""Streaming reader of MediaWiki XML dumps (`*-pages-articles*.xml`, plain or .bz2, multistream
or not) -> articles of clean prose.

Constant memory: pages are parsed one at a time with `iterparse` and cleared after use. The
XML declaration's encoding is honoured (the parser reads bytes). Redirects, disambiguation
pages and pages outside the main namespace are skipped and counted; a truncated archive or
malformed XML raises `CorpusError` naming the file and the position reached.

`read_pages` is the reading half alone (raw wikitext of the pages kept), so that a build can
clean pages (`clean_page`, the costly half) in worker processes; `read_dump` chains the two.
"""

from __future__ import annotations

import bz2
import dataclasses
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import IO, Iterator, NamedTuple

from bertjax.data.errors import CorpusError, SkipCounts
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


def clean_page(page: Page) -> Article | None:
  """The page's article of clean prose; None when no paragraph is left (an "empty article")."""
  paragraphs = clean_wikitext(page.wikitext)
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


def read_dump(path: str | Path, skips: SkipCounts | None = None) -> Iterator[Article]:
  """Articles of the main namespace, in dump order, with clean paragraphs."""
  skips = SkipCounts() if skips is None else skips
  for page in read_pages(path, skips):
    article = clean_page(page)
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
