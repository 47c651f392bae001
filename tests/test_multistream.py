"""Multistream dumps read stream by stream: owned byte ranges that tile the file, the same pages
and skips as reading it whole, only one's own bytes read, and bad input named by its offset."""

import builtins
import bz2
from pathlib import Path

import pytest

from bertjax import paths
from bertjax.data import multistream, wikipedia
from bertjax.data.errors import CorpusError, SkipCounts
from multistream_dump import split_dump, write_multistream_dump


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
  return write_multistream_dump(tmp_path_factory.mktemp("multistream"))


@pytest.fixture(scope="module")
def starts(dump):
  """The true stream offsets, found by decompressing the file stream after stream."""
  data, found, pos = dump.read_bytes(), [], 0
  while pos < len(data):
    found.append(pos)
    decompressor = bz2.BZ2Decompressor()
    decompressor.decompress(data[pos:])
    pos = len(data) - len(decompressor.unused_data)
  return found


def _slices(size, k):
  return [(i * size // k, (i + 1) * size // k) for i in range(k)]


def _one_line_error(excinfo, *parts):
  message = str(excinfo.value)
  assert "\n" not in message, message
  for part in parts:
    assert part in message, (part, message)


class _Recorder:
  """Replaces a module's `open`: every byte range read from a file named `name` is recorded."""

  def __init__(self, name):
    self.name, self.reads = name, []

  def open(self, file, mode="r", *args, **kwargs):
    handle = builtins.open(file, mode, *args, **kwargs)
    return _RecordedFile(handle, self) if Path(file).name == self.name else handle


class _RecordedFile:

  def __init__(self, handle, recorder):
    self.handle, self.recorder = handle, recorder

  def read(self, size=-1):
    pos = self.handle.tell()
    data = self.handle.read(size)
    if data:
      self.recorder.reads.append((pos, pos + len(data)))
    return data

  def __getattr__(self, name):
    return getattr(self.handle, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.handle.close()


def test_index_and_scan_find_the_stream_starts(dump, starts, monkeypatch):
  index = multistream.find_index(dump)
  assert index is not None and index.name.endswith("-multistream-index.txt.bz2")
  size = dump.stat().st_size
  # The index has no line for the last stream, "</mediawiki>" alone: it holds no page.
  assert multistream.stream_starts(dump, 0, size, index) == starts[:-1]
  assert list(multistream.index_offsets(index)) == starts[:-1]
  # Reads of a few bytes put headers across read boundaries (the overlap must find them).
  for chunk in (3, 9, 10, 4096, multistream.SCAN_CHUNK):
    monkeypatch.setattr(multistream, "SCAN_CHUNK", chunk)
    assert multistream.stream_starts(dump, 0, size) == starts, chunk
    assert multistream.stream_starts(dump, starts[3], starts[7]) == starts[3:7], chunk
    assert multistream.stream_starts(dump, starts[3] + 1, starts[7] + 1) == starts[4:8], chunk
    assert multistream.next_stream_start(dump, starts[5] + 1) == starts[6], chunk
    assert multistream.next_stream_start(dump, starts[-1] + 1) == size, chunk


def test_plain_text_index_is_found(dump, starts, tmp_path):
  copy = tmp_path / dump.name
  copy.write_bytes(dump.read_bytes())
  (tmp_path / dump.name.replace(".xml.bz2", "-index.txt")).write_bytes(
      bz2.decompress(multistream.find_index(dump).read_bytes()))
  index = multistream.find_index(copy)
  assert index.name.endswith("-multistream-index.txt")
  assert multistream.stream_starts(copy, 0, copy.stat().st_size, index) == starts[:-1]
  assert multistream.find_index(wikipedia.EMBEDDED_DUMP) is None


@pytest.mark.parametrize("use_index", [True, False], ids=["index", "scan"])
def test_owned_ranges_of_slices_tile_the_file(dump, starts, use_index):
  index = multistream.find_index(dump) if use_index else None
  size = dump.stat().st_size
  true_ranges = list(zip(starts, starts[1:] + [size]))
  if use_index:  # the last two streams are one range: the index does not know the last one
    true_ranges = true_ranges[:-2] + [(starts[-2], size)]
  cuts = [starts[4], starts[4] + 1, starts[9] - 1, starts[9]]  # slice ends at and next to starts
  for slices in [_slices(size, k) for k in (1, 2, 3, 4)] + [list(zip([0] + cuts, cuts + [size]))]:
    owned = [multistream.owned_ranges(dump, lo, hi, index) for lo, hi in slices]
    assert [r for ranges in owned for r in ranges] == true_ranges, slices
    for (lo, hi), ranges in zip(slices, owned):
      assert all(lo <= start < hi for start, _ in ranges), (lo, hi, ranges)
      expected = (ranges[0][0], ranges[-1][1]) if ranges else None
      got = multistream.owned_range(dump, lo, hi, index)
      assert (got if got[0] < got[1] else None) == expected, (lo, hi)


@pytest.mark.parametrize("use_index", [True, False], ids=["index", "scan"])
def test_stream_pages_in_order_are_read_pages(dump, use_index):
  index = multistream.find_index(dump) if use_index else None
  whole_skips, skips = SkipCounts(), SkipCounts()
  whole = list(wikipedia.read_pages(dump, whole_skips))
  assert len(whole) + sum(whole_skips.counts.values()) == 206
  assert whole == list(wikipedia.read_pages(wikipedia.EMBEDDED_DUMP))
  pages = []
  for lo, hi in _slices(dump.stat().st_size, 3):
    for start, end in multistream.owned_ranges(dump, lo, hi, index):
      pages.extend(wikipedia.read_stream_pages(dump, start, end, skips))
  assert pages == whole
  assert skips.counts == whole_skips.counts
  # One range of several streams reads the same pages as its streams one by one.
  size = dump.stat().st_size
  assert list(wikipedia.read_stream_pages(dump, *multistream.owned_range(dump, 0, size, index))) \
      == whole


def test_readers_read_only_their_own_bytes(dump, starts, monkeypatch):
  index = multistream.find_index(dump)
  size = dump.stat().st_size
  recorder = _Recorder(dump.name)
  # The readers open files through bertjax.paths (local files, or objects on a store).
  monkeypatch.setattr(paths, "open", recorder.open, raising=False)
  total = 0
  for lo, hi in _slices(size, 3):
    # With an index, finding the ranges reads nothing of the dump; reading them, exactly them.
    ranges = multistream.owned_ranges(dump, lo, hi, index)
    assert recorder.reads == []
    log = []
    for start, end in ranges:
      list(wikipedia.read_stream_pages(dump, start, end, read_log=log))
    assert log == ranges
    assert multistream.merge_ranges(recorder.reads) == [(ranges[0][0], ranges[-1][1])]
    assert sum(end - start for start, end in recorder.reads) == ranges[-1][1] - ranges[0][0]
    total += sum(end - start for start, end in log)
    recorder.reads.clear()
    # Without: the scan reads [lo, hi + 9), then from hi to the next header and at most one
    # scan chunk beyond.
    next_start = min([s for s in starts if s >= hi] + [size])
    log = []
    assert multistream.owned_ranges(dump, lo, hi, read_log=log) == [
        (s, e) for s, e in zip(starts, starts[1:] + [size]) if lo <= s < hi]
    assert recorder.reads and multistream.merge_ranges(recorder.reads) == \
        multistream.merge_ranges(log)
    assert log[0][0] == lo and hi <= log[0][1] <= min(size, hi + 9)
    assert all(hi <= s and e <= next_start + multistream.SCAN_CHUNK for s, e in log[1:]), log
    recorder.reads.clear()
  assert total == size


def test_truncated_dump(dump, starts, tmp_path):
  cut = tmp_path / dump.name
  end = (starts[6] + starts[7]) // 2
  cut.write_bytes(dump.read_bytes()[:end])
  ranges = multistream.owned_ranges(cut, 0, end)
  assert ranges[-1] == (starts[6], end)
  with pytest.raises(CorpusError) as excinfo:
    list(wikipedia.read_stream_pages(cut, *ranges[-1]))
  _one_line_error(excinfo, cut.name, f"stream at byte {starts[6]} does not end by byte {end}")
  # The whole dump's index: it names streams past the end of the file.
  (tmp_path / multistream.find_index(dump).name).write_bytes(
      multistream.find_index(dump).read_bytes())
  with pytest.raises(CorpusError) as excinfo:
    multistream.owned_ranges(cut, 0, end, multistream.find_index(cut))
  _one_line_error(excinfo, cut.name, f"byte {starts[-2]}, past the end")


def test_corrupt_stream(dump, starts, tmp_path):
  bad = tmp_path / dump.name
  data = bytearray(dump.read_bytes())
  middle = (starts[5] + starts[6]) // 2
  data[middle: middle + 8] = bytes(b ^ 0x5A for b in data[middle: middle + 8])
  bad.write_bytes(bytes(data))
  with pytest.raises(CorpusError) as excinfo:
    for start, end in multistream.owned_ranges(bad, 0, len(data)):
      list(wikipedia.read_stream_pages(bad, start, end))
  _one_line_error(excinfo, bad.name, f"the bz2 stream at byte {starts[5]} is corrupt")


def test_index_offset_that_is_not_a_stream_start(dump, starts, tmp_path):
  copy = tmp_path / dump.name
  copy.write_bytes(dump.read_bytes())
  lines = bz2.decompress(multistream.find_index(dump).read_bytes()).decode().splitlines(True)
  wrong = starts[8] + 100
  lines = [line.replace(f"{starts[8]}:", f"{wrong}:", 1) if line.startswith(f"{starts[8]}:")
           else line for line in lines]
  index = tmp_path / dump.name.replace(".xml.bz2", "-index.txt")
  index.write_text("".join(lines))
  ranges = multistream.owned_ranges(copy, 0, copy.stat().st_size, multistream.find_index(copy))
  assert (starts[7], wrong) in ranges and (wrong, starts[9]) in ranges
  with pytest.raises(CorpusError) as excinfo:  # the stream it falls in does not end there
    list(wikipedia.read_stream_pages(copy, starts[7], wrong))
  _one_line_error(excinfo, copy.name, f"stream at byte {starts[8]} does not end by byte {wrong}")
  with pytest.raises(CorpusError) as excinfo:  # and none starts there
    list(wikipedia.read_stream_pages(copy, wrong, starts[9]))
  _one_line_error(excinfo, copy.name, f"byte {wrong} does not start a bz2 stream")
  index.write_text(lines[0] + "12x:5:Title\n")
  with pytest.raises(CorpusError) as excinfo:
    multistream.index_offsets(index)
  _one_line_error(excinfo, index.name, "line 2 is not OFFSET:PAGE_ID:TITLE")


def test_single_stream_dumps_are_not_multistream(tmp_path):
  assert not multistream.is_multistream(wikipedia.EMBEDDED_DUMP)
  assert len(list(wikipedia.read_pages(wikipedia.EMBEDDED_DUMP))) > 0
  # Streams cut at a fixed size (pbzip2's way): several streams, but pages split between them.
  xml = bz2.decompress(wikipedia.EMBEDDED_DUMP.read_bytes())
  cut = tmp_path / "cut-pages-articles.xml.bz2"
  cut.write_bytes(b"".join(bz2.compress(xml[i: i + 500_000])
                           for i in range(0, len(xml), 500_000)))
  assert not multistream.is_multistream(cut)
  ranges = multistream.owned_ranges(cut, 0, cut.stat().st_size)
  assert len(ranges) > 1
  with pytest.raises(CorpusError) as excinfo:
    list(wikipedia.read_stream_pages(cut, *ranges[1]))
  _one_line_error(excinfo, cut.name, f"byte {ranges[1][0]}")
  assert not multistream.is_multistream(tmp_path / "missing.xml.bz2")


def test_multistream_dump_is_multistream(dump):
  assert multistream.is_multistream(dump)


def test_header_stream_declaration_sets_the_encoding(tmp_path):
  page = ('  <page>\n    <title>Café Müller</title>\n    <ns>0</ns>\n    <id>7</id>\n'
          '    <revision><text>Café Müller is a ballet by Pina Bausch.</text></revision>\n'
          '  </page>\n')
  header = ('<?xml version="1.0" encoding="ISO-8859-1"?>\n<mediawiki xml:lang="en">\n'
            '  <siteinfo><sitename>Wikipedia</sitename></siteinfo>\n')
  streams = [bz2.compress(part.encode("latin-1"))
             for part in (header, page, page.replace("<id>7", "<id>8"), "</mediawiki>\n")]
  path = tmp_path / "latin1-pages-articles-multistream.xml.bz2"
  path.write_bytes(b"".join(streams))
  assert multistream.is_multistream(path)
  first, second = len(streams[0]), len(streams[0]) + len(streams[1])
  expected = wikipedia.Page("7", "Café Müller", "Café Müller is a ballet by Pina Bausch.")
  assert list(wikipedia.read_stream_pages(path, 0, second)) == [expected]
  assert list(wikipedia.read_stream_pages(path, first, second, encoding="ISO-8859-1")) == [expected]
  with pytest.raises(CorpusError) as excinfo:  # read as UTF-8 by default: not valid
    list(wikipedia.read_stream_pages(path, first, second))
  _one_line_error(excinfo, path.name, f"stream at byte {first}")


def test_split_dump_is_byte_for_byte():
  xml = bz2.decompress(wikipedia.EMBEDDED_DUMP.read_bytes())
  header, pages, footer = split_dump(xml)
  assert len(pages) == 206 and header.rstrip().endswith(b"</siteinfo>")
  assert footer.strip() == b"</mediawiki>"
