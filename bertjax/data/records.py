"""Built datasets: tokenized documents in record shards, and the metadata that describes them.

A built dataset is a directory (local or on an object store) written by `bertjax data build`:
`dataset.json`, the `tokenizer/`, and per source and split record shards (one record per
document, sentence boundaries kept) with `.offsets.npy` (random access by index, one exact byte
range per document) and `.tokens.npy` (token counts) beside them. Formats 2 and 3 (ArrayRecord
shards) are still read.

The guide: docs/data.md, 'Building' and 'Streaming from object stores'.
"""

from __future__ import annotations

import dataclasses
import io
import json
import struct
from pathlib import Path

import numpy as np
from etils import epath

from bertjax import paths
from bertjax.data.errors import CorpusError

_MAGIC = b"BJD1"
_HEADER = struct.Struct("<4sIIII")  # magic, key bytes, sentences, tokens, bytes per token
# Vocabularies up to 65,536 (BERT's 30,522, GPT-2's 50,257) store 2 bytes per token.
_TOKEN_DTYPES = {2: "<u2", 4: "<i4"}
SPLITS = ("train", "eval")
# 4: record shards with byte offsets. 3: ArrayRecord shards, a source's "weight" null where the
# build stated none. 2: ArrayRecord, 1.0 written there. All three read.
FORMAT_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)


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
# are sentence-based): the header, the key, the sentence lengths and the token ids, all
# little-endian, so decoding is two `np.frombuffer` calls. The shard's offsets give each
# document as one exact byte range, which an object store serves without the rest of the shard.
def encode_record(key: str, sentences: list[list[int]]) -> bytes:
  key_bytes = key.encode("utf-8")
  lengths = np.array([len(s) for s in sentences], "<i4")
  tokens = np.fromiter((t for s in sentences for t in s), "<i4", count=int(lengths.sum()))
  width = 2 if tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < 2**16) else 4
  return (_HEADER.pack(_MAGIC, len(key_bytes), len(lengths), len(tokens), width) + key_bytes +
          lengths.tobytes() + tokens.astype(_TOKEN_DTYPES[width]).tobytes())


def decode_record(record: bytes) -> TokenizedDocument:
  magic, key_len, num_sentences, num_tokens, width = _HEADER.unpack_from(record)
  if magic != _MAGIC:
    raise CorpusError(f"not a bertjax document record (magic {magic!r})")
  offset = _HEADER.size
  key = record[offset:offset + key_len].decode("utf-8")
  offset += key_len
  lengths = np.frombuffer(record, "<i4", num_sentences, offset)
  tokens = np.frombuffer(record, _TOKEN_DTYPES[width], num_tokens, offset + 4 * num_sentences)
  return TokenizedDocument(key, lengths, tokens)


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
  """A .npy file, local or on an object store (one read of the whole file)."""
  return np.load(io.BytesIO(path.read_bytes()))


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
  return _HEADER.unpack_from(record)[3]


@dataclasses.dataclass(frozen=True)
class BuiltDataset:
  """A built dataset directory (local or on an object store). Opening reads dataset.json only;
  a source's shards are checked when the loader first asks for them (`shard_paths`), so that
  sources a run leaves out cost nothing at start-up."""

  root: epath.Path
  meta: dict
  # source -> the names in its directory (one listing per source used, not a stat per shard)
  _listings: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
  # (source, split) -> its records' reader, opened once per process (bertjax.data.shards)
  readers: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @classmethod
  def open(cls, root: str | Path | epath.Path) -> BuiltDataset:
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
    return cls(root, meta)

  @property
  def format_version(self) -> int:
    return int(self.meta["format_version"])

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
