"""Wikipedia *multistream* dumps: where their bz2 streams start, so that readers share a dump out
by bytes.

The owner of the byte slice [lo, hi) owns the streams that start in it and reads the bytes
[first start >= lo, first start >= hi), so slices that tile the file give ranges that tile it
(`owned_ranges`, `owned_range`). Stream starts come from the companion index
(`OFFSET:PAGE_ID:TITLE` per page), else from a scan for bz2 stream headers; a false header or a
stale index is a `CorpusError` naming the offset, never a silent mis-parse.

The guide: docs/data.md, 'MediaWiki dumps → articles'.
"""

from __future__ import annotations

import array
import bisect
import bz2
import contextlib
import os
from pathlib import Path

from bertjax import paths
from bertjax.data.errors import CorpusError

STREAM_MAGIC = b"BZh"
# What follows "BZhN" at a stream start: the first block's header magic, or (an empty stream)
# the end-of-stream magic.
BLOCK_MAGIC = b"1AY&SY"
END_MAGIC = b"\x17\x72\x45\x38\x50\x90"
HEADER_BYTES = 10  # "BZh" + level digit + 6 magic bytes
_LEVELS = b"123456789"
SCAN_CHUNK = 1 << 16  # bytes per read when scanning for headers
_INDEX_BLOCK = 1 << 20
# The header stream of a real dump is a few KiB (the namespace list); a first stream that
# decompresses to more than this is not one (a single-stream dump, or pbzip2's 900k blocks).
_MAX_HEADER = 1 << 20

# Offsets of each index read in this process (an enwiki index has ~24M lines), keyed by the
# file's identity so that a rewritten index is read again.
_INDEX_CACHE: dict[tuple[str, int, int], array.array] = {}


def find_index(dump: str | Path) -> Path | None:
  """The index next to a multistream dump, by the dump naming convention
  (`…-multistream.xml.bz2` -> `…-multistream-index.txt.bz2`, else `.txt`); None if absent."""
  dump = paths.path(dump)
  if not dump.name.endswith("-multistream.xml.bz2"):
    return None
  stem = dump.name[: -len(".xml.bz2")]
  for suffix in ("-index.txt.bz2", "-index.txt"):
    candidate = dump.with_name(stem + suffix)
    if candidate.is_file():
      return candidate
  return None


def is_multistream(dump: str | Path) -> bool:
  """Whether `dump` is a bz2 multistream dump: its first stream is a header alone (the
  `<mediawiki>` tag and `<siteinfo>`, no page) and another stream follows it. Reads only the
  first stream (a few KiB); anything else, unreadable files included, is False (read it whole
  with `wikipedia.read_pages`, which reports what is wrong with it)."""
  try:
    with paths.open_binary(dump) as file:
      if not is_stream_header(file.read(HEADER_BYTES), 0):
        return False
      file.seek(0)
      decompressor = bz2.BZ2Decompressor()
      header = b""
      while not decompressor.eof:
        data = file.read(SCAN_CHUNK)
        if not data or file.tell() > _MAX_HEADER:
          return False
        header += decompressor.decompress(data, _MAX_HEADER - len(header) + 1)
        if len(header) > _MAX_HEADER:
          return False
      rest = decompressor.unused_data
      rest += file.read(max(0, HEADER_BYTES - len(rest)))
  except (OSError, EOFError):
    return False
  return (b"<page" not in header and header.rstrip().endswith(b"</siteinfo>")
          and is_stream_header(rest, 0))


# Functions that read the dump append the (start, end) byte ranges they read to `read_log`.
def stream_starts(dump: str | Path, lo: int, hi: int, index: str | Path | None = None,
                  read_log: list[tuple[int, int]] | None = None) -> list[int]:
  """Byte offsets of the bz2 streams that start in [lo, hi), ascending. With an index: its
  distinct offsets and 0 (the header stream); the dump is not read. Without: a scan of the
  dump's bytes [lo, hi + 9) (a header starting before hi ends before hi + 10)."""
  dump = paths.path(dump)
  size = _size(dump)
  lo, hi = max(lo, 0), min(hi, size)
  if lo >= hi:
    return []
  if index is not None:
    offsets = _checked_offsets(dump, paths.path(index), size)
    return list(offsets[bisect.bisect_left(offsets, lo): bisect.bisect_left(offsets, hi)])
  with _open_dump(dump) as file:
    starts = _scan(file, lo, hi, min(size, hi + HEADER_BYTES - 1), read_log)
  if lo == 0 and starts[:1] != [0]:
    raise CorpusError(f"{dump}: byte 0 does not start a bz2 stream — not a bz2 multistream dump")
  return starts


def next_stream_start(dump: str | Path, pos: int, index: str | Path | None = None,
                      read_log: list[tuple[int, int]] | None = None) -> int:
  """The offset of the first bz2 stream that starts at or after `pos`; the file's size if none
  does. With an index the dump is not read; without, it is scanned forward from `pos` until a
  header, reading at most `SCAN_CHUNK` bytes past that header."""
  dump = paths.path(dump)
  size = _size(dump)
  if pos >= size:
    return size
  pos = max(pos, 0)
  if index is not None:
    offsets = _checked_offsets(dump, paths.path(index), size)
    i = bisect.bisect_left(offsets, pos)
    return offsets[i] if i < len(offsets) else size
  with _open_dump(dump) as file:
    found = _scan(file, pos, size, size, read_log, first_only=True)
  return found[0] if found else size


def owned_ranges(dump: str | Path, lo: int, hi: int, index: str | Path | None = None,
                 read_log: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
  """The byte range [start, next start or end of file) of each bz2 stream that starts in
  [lo, hi): what the owner of the slice [lo, hi) reads, one range per stream. Slices that tile
  [0, size) give ranges that tile it. Without an index, scans [lo, hi + 9) and then forward from
  hi to the next header (`next_stream_start`)."""
  starts = stream_starts(dump, lo, hi, index, read_log)
  if not starts:
    return []
  ends = starts[1:] + [next_stream_start(dump, hi, index, read_log)]
  return list(zip(starts, ends))


def owned_range(dump: str | Path, lo: int, hi: int, index: str | Path | None = None,
                read_log: list[tuple[int, int]] | None = None) -> tuple[int, int]:
  """The bytes [first stream start >= lo, first stream start >= hi) as one range (empty when no
  stream starts in [lo, hi)): the same bytes as `owned_ranges`, for a reader that does not need
  them stream by stream (`read_stream_pages` reads several streams in a row). Without an index
  it scans only up to the first header after lo and after hi, not all of [lo, hi)."""
  start = next_stream_start(dump, lo, index, read_log)
  if start >= hi:
    return (start, start)
  return (start, next_stream_start(dump, hi, index, read_log))


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """Byte ranges (a `read_log`) as the fewest disjoint ranges covering them, ascending: what was
  read, each byte once."""
  merged: list[tuple[int, int]] = []
  for start, end in sorted(r for r in ranges if r[0] < r[1]):
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    else:
      merged.append((start, end))
  return merged


def index_offsets(index: str | Path) -> array.array:
  """The distinct stream offsets of an index file and 0 (the header stream, which holds no
  page), ascending; read once per process (streamed: the file may be large). A malformed line,
  or an offset smaller than the one before it, is a `CorpusError` naming the line."""
  index = paths.path(index)
  try:
    size = paths.file_size(index)
    mtime = 0 if paths.is_remote(index) else os.stat(index).st_mtime_ns
  except OSError as e:
    raise CorpusError(f"{index}: cannot be read ({e.strerror or e})") from None
  key = (os.fspath(index), mtime, size)
  if key not in _INDEX_CACHE:
    _INDEX_CACHE.clear()  # one index at a time: they are large
    _INDEX_CACHE[key] = _read_index(index)
  return _INDEX_CACHE[key]


def _read_index(index: Path) -> array.array:
  offsets = array.array("q", [0])
  # Consecutive lines share their offset (~100 pages a stream): a line that starts with the
  # previous offset and its colon is skipped without parsing.
  same = b"0:"
  number = 0  # lines before the current block
  tail = b""
  try:
    with paths.open_binary(index) as raw:
      compressed = raw.read(3) == STREAM_MAGIC
      raw.seek(0)
      with bz2.open(raw, "rb") if compressed else contextlib.nullcontext(raw) as file:
        while True:
          block = file.read(_INDEX_BLOCK)
          if not block:
            lines = [tail] if tail else []
          else:
            lines = (tail + block).split(b"\n")
            tail = lines.pop()
          for i, line in enumerate(lines):
            if line.startswith(same) or not line.strip():
              continue
            head, _, rest = line.partition(b":")
            page_id, colon, _ = rest.partition(b":")
            if not (head.isdigit() and page_id.strip().isdigit() and colon):
              raise CorpusError(f"{index}: line {number + i + 1} is not OFFSET:PAGE_ID:TITLE")
            offset = int(head)
            if offset < offsets[-1]:
              raise CorpusError(f"{index}: line {number + i + 1}: offset {offset} is smaller "
                                f"than the one before it ({offsets[-1]})")
            if offset > offsets[-1]:
              offsets.append(offset)
            same = head + b":"
          number += len(lines)
          if not block:
            return offsets
  except (OSError, EOFError) as e:
    raise CorpusError(f"{index}: cannot be read after line {number} ({e})") from None


def _checked_offsets(dump: Path, index: Path, size: int) -> array.array:
  offsets = index_offsets(index)
  if offsets[-1] >= size:
    raise CorpusError(f"{dump}: index {index.name} has a stream at byte {offsets[-1]}, past the "
                      f"end of the file ({size} bytes): a truncated dump, or not its index")
  return offsets


def _size(dump: Path) -> int:
  try:
    return paths.file_size(dump)
  except FileNotFoundError:
    raise CorpusError(f"{dump}: no such file") from None
  except OSError as e:
    raise CorpusError(f"{dump}: cannot be read ({e.strerror or e})") from None


def _open_dump(dump: Path):
  try:
    return paths.open_binary(dump)
  except OSError as e:
    raise CorpusError(f"{dump}: cannot be read ({e.strerror})") from None


def is_stream_header(data: bytes, i: int = 0) -> bool:
  """Whether the header of a bz2 stream ("BZh", a level digit, the magic of a first block or of
  an empty stream's end) starts at data[i]."""
  return (data[i:i + 3] == STREAM_MAGIC and data[i + 3:i + 4] != b"" and data[i + 3] in _LEVELS
          and data[i + 4:i + HEADER_BYTES] in (BLOCK_MAGIC, END_MAGIC))


def _scan(file, lo: int, hi: int, stop: int, read_log: list[tuple[int, int]] | None,
          first_only: bool = False) -> list[int]:
  """Offsets of the stream headers that start in [lo, hi), reading the bytes [lo, stop) in
  chunks (stop >= hi + 9 unless the file ends sooner); the first one only if `first_only`, then
  reading no further."""
  found = []
  file.seek(lo)
  pos = lo  # next byte to read
  base = lo  # file offset of data[0]
  data = b""
  try:
    while pos < stop:
      chunk = file.read(min(SCAN_CHUNK, stop - pos))
      if not chunk:
        break
      pos += len(chunk)
      # The last HEADER_BYTES - 1 bytes of the previous chunk come along: a header split
      # across two reads is seen whole.
      data = data + chunk
      i = data.find(STREAM_MAGIC)
      while i != -1 and i + HEADER_BYTES <= len(data):
        if base + i >= hi:
          return found
        if is_stream_header(data, i):
          found.append(base + i)
          if first_only:
            return found
        i = data.find(STREAM_MAGIC, i + 1)
      keep = min(len(data), HEADER_BYTES - 1)
      base += len(data) - keep
      data = data[len(data) - keep:]
    return found
  finally:
    if read_log is not None and pos > lo:
      read_log.append((lo, pos))
