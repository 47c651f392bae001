"""A genuine Wikipedia multistream dump (and its index) made from a single-stream dump, for
tests: the pages' XML is copied byte for byte, so both read as the same pages."""

from __future__ import annotations

import bz2
import html
import re
from pathlib import Path

from bertjax.data.wikipedia import EMBEDDED_DUMP

_PAGE_START = re.compile(rb"^[ \t]*<page>", re.M)
_PAGE_END = re.compile(rb"</page>[ \t]*\n", re.M)
_FIELD = re.compile(rb"<(title|id)>([^<]*)</\1>")


def split_dump(xml: bytes) -> tuple[bytes, list[bytes], bytes]:
  """(header, pages, footer) of a dump's XML, each page from the start of its `<page>` line to
  the end of its `</page>` line; their concatenation is `xml`."""
  first = _PAGE_START.search(xml)
  header, pos, pages = xml[: first.start()], first.start(), []
  while start := _PAGE_START.match(xml, pos):  # pages follow one another, line after line
    end = _PAGE_END.search(xml, start.end())
    pages.append(xml[pos: end.end()])
    pos = end.end()
  footer = xml[pos:]
  assert header + b"".join(pages) + footer == xml and b"<page>" not in footer
  return header, pages, footer


def write_multistream_dump(out: Path, pages_per_stream: int = 10, with_index: bool = True,
                           source: Path = EMBEDDED_DUMP) -> Path:
  """Writes `source` (a single-stream `…-pages-articles.xml.bz2`) into the directory `out` as
  `…-pages-articles-multistream.xml.bz2`: a header stream (XML declaration if any, `<mediawiki
  …>`, `<siteinfo>`), one bz2 stream per `pages_per_stream` pages, a last stream with
  `</mediawiki>`; with `with_index`, its `…-multistream-index.txt.bz2` (OFFSET:PAGE_ID:TITLE
  lines, as Wikimedia writes them). Returns the dump's path."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  header, pages, footer = split_dump(bz2.decompress(source.read_bytes()))
  name = source.name.removesuffix(".xml.bz2") + "-multistream.xml.bz2"
  dump = out / name
  streams = [header] + [b"".join(pages[i: i + pages_per_stream])
                        for i in range(0, len(pages), pages_per_stream)] + [footer]
  lines, offset = [], 0
  with open(dump, "wb") as file:
    for n, stream in enumerate(streams):
      if 0 < n < len(streams) - 1:
        for page in pages[(n - 1) * pages_per_stream: n * pages_per_stream]:
          fields = {}
          for key, value in _FIELD.findall(page):  # the first <id> is the page's
            fields.setdefault(key, value.decode("utf-8"))
          lines.append(f"{offset}:{fields[b'id']}:{html.unescape(fields[b'title'])}\n")
      compressed = bz2.compress(stream, 9)
      file.write(compressed)
      offset += len(compressed)
  if with_index:
    index = out / (name.removesuffix(".xml.bz2") + "-index.txt.bz2")
    index.write_bytes(bz2.compress("".join(lines).encode("utf-8")))
  return dump
