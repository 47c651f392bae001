"""Built datasets: tokenized documents in record shards, and the metadata that describes them.

A built dataset is a directory (local or on an object store) written by `bertjax data build`:
`dataset.json`, the `tokenizer/`, and per source and split record shards (one record per
document, sentence boundaries kept, with a CRC-32 of its bytes) with `.offsets.npy` (random
access by index, one exact byte range per document) and `.tokens.npy` (token counts) beside
them. Format 4 (records without checksums) and formats 2 and 3 (ArrayRecord shards) are still
read, unchecked.

The guide: docs/data.md, 'Building' and 'Streaming from object stores'.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import struct
import zlib
from pathlib import Path

import numpy as np
from etils import epath

from bertjax import paths
from bertjax.data.errors import CorpusError

log = logging.getLogger(__name__)

# A record: magic, (format 5 on) the CRC-32 of every byte after it, then the fields.
_MAGIC = b"BJD2"
_UNCHECKED_MAGIC = b"BJD1"  # formats 2-4: no checksum
_CHECKSUM = struct.Struct("<I")
_FIELDS = struct.Struct("<IIII")  # key bytes, sentences, tokens, bytes per token
# Vocabularies up to 65,536 (BERT's 30,522, GPT-2's 50,257) store 2 bytes per token.
_TOKEN_DTYPES = {2: "<u2", 4: "<i4"}
SPLITS = ("train", "eval")
# 5: records carry a CRC-32, checked on every read. 4: record shards with byte offsets. 3:
# ArrayRecord shards, a source's "weight" null where the build stated none. 2: ArrayRecord,
# 1.0 written there. All four read.
FORMAT_VERSION = 5
READABLE_VERSIONS = (2, 3, 4, 5)
CHECKSUMS_FROM = 5
# Roots whose "read unchecked" line this process has logged (one line per dataset, not per open).
_UNCHECKED_LOGGED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class TokenizedDocument:
  key: str  # "<source>:<document id>": unique in the dataset, stable across builds
  sentence_lengths: np.ndarray  # int32 [num_sentences]
  tokens: np.ndarray  # [num_tokens] uint16 or int32, the sentences concatenated

  def sentences(self) -> list[list[int]]:
    """The sentences as lists of ids (what BERT instance creation consumes)."""
    tokens = self.tokens.tolist()
    ends = np.cumsum(self.sentence_lengths).tolist()
    return [tokens[start:end] for start, end in zip([0] + ends[:-1], ends)]

  def lazy_sentences(self) -> LazySentences:
    """The sentences, converted to lists only when indexed (for random-next documents, of
    which only a few sentences are read)."""
    return LazySentences(self)


class LazySentences:

  def __init__(self, doc: TokenizedDocument):
    self._tokens = doc.tokens
    self._ends = np.cumsum(doc.sentence_lengths).tolist()

  def __len__(self) -> int:
    return len(self._ends)

  def __getitem__(self, i: int) -> list[int]:
    start = self._ends[i - 1] if i > 0 else 0
    return self._tokens[start:self._ends[i]].tolist()


# One record is one document with its sentence boundaries kept (BERT pairs and RoBERTa packing
# are sentence-based): the magic, a CRC-32 of everything after it, the fields, the key, the
# sentence lengths and the token ids, all little-endian, so decoding is two `np.frombuffer`
# calls. The shard's offsets give each document as one exact byte range, which an object store
# serves without the rest of the shard, and the checksum travels with the record: a reader of
# one byte range checks exactly what it read.
def encode_record(key: str, sentences: list[list[int]]) -> bytes:
  key_bytes = key.encode("utf-8")
  lengths = np.array([len(s) for s in sentences], "<i4")
  tokens = np.fromiter((t for s in sentences for t in s), "<i4", count=int(lengths.sum()))
  width = 2 if tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < 2**16) else 4
  body = (_FIELDS.pack(len(key_bytes), len(lengths), len(tokens), width) + key_bytes +
          lengths.tobytes() + tokens.astype(_TOKEN_DTYPES[width]).tobytes())
  return _MAGIC + _CHECKSUM.pack(zlib.crc32(body)) + body


def _fields_offset(magic: bytes) -> int | None:
  """Where a record's fields start, by its magic (None: not a bertjax record)."""
  if magic == _MAGIC:
    return len(_MAGIC) + _CHECKSUM.size
  if magic == _UNCHECKED_MAGIC:
    return len(_UNCHECKED_MAGIC)
  return None


def decode_record(record: bytes) -> TokenizedDocument:
  """The document in a record (checked or not: `record_damage` is the check)."""
  magic = bytes(record[:4])
  offset = _fields_offset(magic)
  if offset is None:
    raise CorpusError(f"not a bertjax document record (magic {magic!r})")
  key_len, num_sentences, num_tokens, width = _FIELDS.unpack_from(record, offset)
  offset += _FIELDS.size
  key = bytes(record[offset:offset + key_len]).decode("utf-8")
  offset += key_len
  lengths = np.frombuffer(record, "<i4", num_sentences, offset)
  tokens = np.frombuffer(record, _TOKEN_DTYPES[width], num_tokens, offset + 4 * num_sentences)
  return TokenizedDocument(key, lengths, tokens)


def record_damage(record: bytes, checksummed: bool) -> str | None:
  """Why `record` cannot be read as written, or None. A checksummed record (format 5) must
  match its CRC-32, which any change of up to 32 consecutive bits, of the fields, key or
  tokens, fails; a record of format 4 can only be checked for a consistent header: its magic,
  the lengths it states against its size, its sentence lengths against its token count (a
  changed token id passes)."""
  expected = _MAGIC if checksummed else _UNCHECKED_MAGIC
  magic = bytes(record[:4])
  if magic != expected:
    return f"damaged header: magic {magic!r}, not {expected!r}"
  offset = _fields_offset(magic)
  if len(record) < offset + _FIELDS.size:
    return f"damaged header: {len(record)} bytes, shorter than a header"
  if checksummed and zlib.crc32(memoryview(record)[offset:]) != _CHECKSUM.unpack_from(
      record, len(_MAGIC))[0]:
    return "checksum mismatch"
  key_len, num_sentences, num_tokens, width = _FIELDS.unpack_from(record, offset)
  stated = offset + _FIELDS.size + key_len + 4 * num_sentences + width * num_tokens
  if width not in _TOKEN_DTYPES or stated != len(record):
    return (f"damaged header: it states {stated} bytes at {width} per token, the record has "
            f"{len(record)}")
  lengths = np.frombuffer(record, "<i4", num_sentences, offset + _FIELDS.size + key_len)
  total = int(lengths.sum(dtype=np.int64))
  if (lengths < 0).any() or total != num_tokens:
    return f"damaged sentence lengths: they sum to {total} of {num_tokens} tokens"
  try:
    bytes(record[offset + _FIELDS.size:offset + _FIELDS.size + key_len]).decode("utf-8")
  except UnicodeDecodeError:
    return "damaged key: not UTF-8"
  return None


@dataclasses.dataclass(frozen=True)
class CorruptRecord:
  """A record that failed `record_damage`: its shard file, its index there, and why."""

  shard: str
  index: int
  reason: str


def shard_name(split: str, shard: int, num_shards: int,
               format_version: int = FORMAT_VERSION) -> str:
  suffix = ".records" if format_version >= 4 else ".array_record"
  return f"{split}-{shard:05d}-of-{num_shards:05d}{suffix}"


def _beside(shard: epath.Path, suffix: str) -> epath.Path:
  return shard.with_name(shard.name.rsplit(".", 1)[0] + suffix)


def token_counts_path(shard: epath.Path) -> epath.Path:
  """The token counts beside a shard: the loader balances rows by them without reading the
  documents (datasets built before them are read once instead)."""
  return _beside(shard, ".tokens.npy")


def offsets_path(shard: epath.Path) -> epath.Path:
  """The byte offsets beside a record shard: record i is bytes [offsets[i], offsets[i + 1])."""
  return _beside(shard, ".offsets.npy")


def load_array(path: epath.Path) -> np.ndarray:
  """A .npy file, local or on an object store (one read of the whole file); a damaged one is
  a CorpusError naming it."""
  data = path.read_bytes()
  try:
    return np.load(io.BytesIO(data), allow_pickle=False)
  except (ValueError, EOFError) as e:  # numpy's errors for a damaged header or a short file
    raise CorpusError(f"{path}: not a readable .npy array ({e}); rebuild the dataset") from None


class ShardWriter:
  """One shard: its records, and on `close` the offsets and token count of each beside it."""

  def __init__(self, path: Path):
    self._path, self._tokens, self._offsets = Path(path), [], [0]
    self._file = open(path, "wb")

  def write(self, record: bytes, num_tokens: int) -> None:
    self._file.write(record)
    self._offsets.append(self._offsets[-1] + len(record))
    self._tokens.append(num_tokens)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      np.save(offsets_path(self._path), np.asarray(self._offsets, "<u8"))
      np.save(token_counts_path(self._path), np.asarray(self._tokens, "<u4"))
      self._file = None


def record_token_count(record: bytes) -> int:
  """A record's token count, from its header."""
  offset = _fields_offset(bytes(record[:4]))
  if offset is None:
    raise CorpusError(f"not a bertjax document record (magic {bytes(record[:4])!r})")
  return _FIELDS.unpack_from(record, offset)[2]


@dataclasses.dataclass(frozen=True)
class BuiltDataset:
  """A built dataset directory (local or on an object store). Opening reads dataset.json only;
  a source's shards are checked when the loader first asks for them (`shard_paths`), so that
  sources a run leaves out cost nothing at start-up."""

  root: epath.Path
  meta: dict
  # A record that fails its check is skipped (its reader returns None and counts it,
  # bertjax.data.shards) rather than raised as a CorpusError naming it.
  skip_corrupt: bool = dataclasses.field(default=False, compare=False)
  # source -> the names in its directory (one listing per source used, not a stat per shard)
  _listings: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
  # (source, split) -> its records' reader, opened once per process (bertjax.data.shards)
  readers: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @classmethod
  def open(cls, root: str | Path | epath.Path, skip_corrupt: bool = False) -> BuiltDataset:
    """The dataset at `root` (dataset.json read and its version checked); `skip_corrupt`: as
    the field. A dataset built before record checksums says once that it is read unchecked."""
    root = paths.path(root)
    meta_path = root / "dataset.json"
    if not meta_path.is_file():
      raise CorpusError(f"{root}: not a built dataset (no dataset.json); create one with "
                        "`bertjax data build`")
    meta = json.loads(meta_path.read_text())
    if meta.get("format_version") not in READABLE_VERSIONS:
      raise CorpusError(f"{meta_path}: format version {meta.get('format_version')}, this "
                        f"bertjax reads {', '.join(map(str, READABLE_VERSIONS))}; rebuild "
                        "the dataset")
    if meta["format_version"] < CHECKSUMS_FROM and str(root) not in _UNCHECKED_LOGGED:
      _UNCHECKED_LOGGED.add(str(root))
      log.warning("%s: format %d, built before record checksums: its records are read "
                  "unchecked (a changed token id goes unnoticed); rebuild it to check every "
                  "record", root, meta["format_version"])
    return cls(root, meta, skip_corrupt)

  @property
  def format_version(self) -> int:
    return int(self.meta["format_version"])

  @property
  def checksummed(self) -> bool:
    """Its records carry CRC-32s (format 5 on)."""
    return self.format_version >= CHECKSUMS_FROM

  @property
  def source_names(self) -> list[str]:
    return [s["name"] for s in self.meta["sources"]]

  @property
  def weights(self) -> dict[str, float | None]:
    """Each source's mixing weight as the build stated it; None: not stated (the loader then
    weights every source by its size)."""
    weights = {s["name"]: None if s.get("weight") is None else float(s["weight"])
               for s in self.meta["sources"]}
    if self.meta.get("format_version") == 2 and all(w == 1.0 for w in weights.values()):
      # Format 2 wrote 1.0 for a weight not given: all 1.0 is a build that stated none.
      return dict.fromkeys(weights)
    return weights

  @property
  def num_shards(self) -> int:
    return int(self.meta["num_shards"])

  @property
  def tokenizer_dir(self) -> Path:
    """The tokenizer's files as a local directory (copied once per host from an object
    store: SentencePiece reads local files)."""
    return paths.local_copy(self.root / "tokenizer")

  def shard_paths(self, source: str, split: str) -> list[epath.Path]:
    """The shards of one source's split, checked present (CorpusError naming one missing)."""
    if source not in self.source_names:
      raise CorpusError(f"{self.root}: no source {source!r}; its sources are "
                        f"{self.source_names}")
    shards = [self.root / source / shard_name(split, s, self.num_shards, self.format_version)
              for s in range(self.num_shards)]
    if source not in self._listings:
      folder = self.root / source
      self._listings[source] = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    needed = [p for shard in shards for p in (
        (shard, offsets_path(shard), token_counts_path(shard)) if self.format_version >= 4
        else (shard,))]
    missing = [str(p) for p in needed if p.name not in self._listings[source]]
    if missing:
      raise CorpusError(f"{self.root}: {len(missing)} shard file(s) of {source}/{split} "
                        f"missing, e.g. {missing[0]} — the build did not finish on every "
                        "process")
    return shards

  def parts(self) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((self.root / "parts").glob("*.json"))]

  def counts(self) -> dict:
    """Documents/sentences/tokens per source and split, summed over the build processes."""
    totals: dict = {}
    for part in self.parts():
      for name, splits in part["counts"].items():
        for split, c in splits.items():
          t = totals.setdefault(name, {}).setdefault(split, {})
          for k, v in c.items():
            t[k] = t.get(k, 0) + v
    return totals
