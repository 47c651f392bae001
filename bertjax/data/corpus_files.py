"""Finding a source's files and streaming their lines, for the readers of the line-oriented kinds
(bertjax.data.readers): `input_files` (a file, a directory tree or a glob -> (file, label) pairs
in sorted label order, hidden files left out), `text_files` (empty and binary files skipped and
counted; a source whose files are binary and none text is a `CorpusError`, surely a wrong path),
`text_lines` (a bounded `readline` on a binary handle, gzip and bzip2 recognised by their magic
bytes, decoded with the source's encoding) and `Skipper` (skips counted by reason, the first few
of each logged with file:line). The skip reasons and errors: docs/data.md, 'Sources'.
"""

from __future__ import annotations

import bz2
import codecs
import collections
import glob
import gzip
import io
import logging
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from bertjax.data.errors import CorpusError, SkipCounts

log = logging.getLogger(__name__)

# A line longer than this is skipped (and counted), never built in memory.
MAX_LINE_BYTES = 1 << 20
# How much of a file's (decompressed) start is checked for NUL bytes, as git and grep do.
BINARY_PROBE_BYTES = 8192
# Skips of one reason logged per source read; the rest are only counted.
WARNINGS_PER_REASON = 5

_DRAIN_BYTES = 1 << 16  # chunk size when discarding the rest of an over-long line


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


def input_files(path: str | Path, accept: Callable[[str], bool],
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


def suffixes(*names: str) -> Callable[[str], bool]:
  """A file-name filter for `input_files`: names ending in one of `names` (any case),
  optionally .gz or .bz2."""
  compressed = tuple(f"{n}{c}" for n in names for c in ("", ".gz", ".bz2"))
  return lambda filename: filename.lower().endswith(compressed)


# --------------------------------------------------------------------------- reading lines


class Skipper:
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


def text_files(files: list[tuple[Path, str]], skip: Skipper,
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


def text_lines(path: Path, skip: Skipper, max_line_bytes: int,
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


def _wide_lines(path: Path, skip: Skipper, max_line_bytes: int,
                encoding: str) -> Iterator[tuple[int, str]]:
  """`text_lines` for codecs with multi-byte units (UTF-16/32): decoded incrementally, so lines
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

