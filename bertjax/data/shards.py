"""Random access to the records of a built dataset's shards, on local disk or on an object store
(`gs://` and every other fsspec store the path layer reads).

`ShardRecords` reads record i as the one byte range the shard's offsets give: `os.pread` on
local disk, one ranged GET on an object store, so a host fetches only the documents its rows
read. Every record read is checked (`records.record_damage`); a corrupt one is a CorpusError
naming the shard file and index or, skipping, None (Grain leaves None out, so no stage
downstream sees it). Formats 2 and 3 (ArrayRecord) are read through Grain (`open_records`).

The guide: docs/data.md, 'Streaming from object stores' and 'Corrupt records'.
"""

from __future__ import annotations

import bisect
import collections
import os
import threading
from typing import Any

import fsspec
import grain
import numpy as np

from bertjax import paths
from bertjax.data import records
from bertjax.data.errors import CorpusError

# Enough for the few hundred documents a process's rows and BERT's random-next reads revisit.
DEFAULT_CACHE_BYTES = 64 << 20


class ShardRecords:
  """Grain random-access source over record shards: `len`, `[i]` -> the record's bytes, in the
  order of `shards` then of their records. `checksummed`: the records carry CRC-32s (format 5);
  `skip_corrupt`: a record that fails its check reads as None, and is listed by
  `corrupt_records`, instead of raising. Picklable (loader workers reopen files and clients)."""

  def __init__(self, shards: list[Any], cache_bytes: int = DEFAULT_CACHE_BYTES, *,
               checksummed: bool = True, skip_corrupt: bool = False):
    self._shards = [os.fspath(s) for s in shards]
    self._checksummed, self._skip_corrupt = checksummed, skip_corrupt
    # Global index -> what this process found corrupt there. A verdict is final, so a record
    # is fetched, checked and reported once however often the loader asks for it (BERT's
    # random-next reads).
    self._corrupt: dict[int, records.CorruptRecord] = {}
    self._offsets = []
    for shard in shards:
      offsets_file = records.offsets_path(paths.path(shard))
      offsets = records.load_array(offsets_file).astype(np.int64)
      if len(offsets) < 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise CorpusError(f"{offsets_file}: not a shard's offsets "
                          "(they must start at 0 and never decrease); rebuild the dataset")
      self._offsets.append(offsets)
    self._ends = np.cumsum([len(o) - 1 for o in self._offsets]).tolist()
    self._remote = [paths.is_remote(s) for s in self._shards]
    self._cache_bytes = int(cache_bytes)
    self._open()

  def _open(self) -> None:
    self._lock = threading.Lock()
    self._files: dict[int, Any] = {}  # shard -> fd (local) or (filesystem, path) (remote)
    self._cache: collections.OrderedDict[int, bytes] = collections.OrderedDict()
    self._cached = 0

  def __getstate__(self) -> dict:
    state = self.__dict__.copy()
    for key in ("_lock", "_files", "_cache", "_cached"):
      state.pop(key)
    return state

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self._open()

  def __len__(self) -> int:
    return self._ends[-1] if self._ends else 0

  def shard_size(self, shard: int) -> int:
    """The records in shard number `shard` (of the list given)."""
    return len(self._offsets[shard]) - 1

  def __repr__(self) -> str:
    return f"ShardRecords({len(self._shards)} shards, {len(self)} records)"

  def _handle(self, shard: int) -> Any:
    with self._lock:
      if shard not in self._files:
        name = self._shards[shard]
        if self._remote[shard]:
          self._files[shard] = fsspec.core.url_to_fs(name)
        else:
          self._files[shard] = os.open(name, os.O_RDONLY)
      return self._files[shard]

  def __getitem__(self, index: int) -> bytes | None:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"record {index} of {len(self)}")
    with self._lock:
      if index in self._cache:
        self._cache.move_to_end(index)
        return self._cache[index]
      if index in self._corrupt:
        return None
    shard = bisect.bisect_right(self._ends, index)
    i = index - (self._ends[shard - 1] if shard else 0)
    start, end = int(self._offsets[shard][i]), int(self._offsets[shard][i + 1])
    handle = self._handle(shard)
    if self._remote[shard]:
      fs, path = handle
      data = fs.cat_file(path, start=start, end=end)
    else:
      data = os.pread(handle, end - start, start)
    if len(data) != end - start:
      damage = (f"truncated shard: the record is bytes [{start}, {end}) but {len(data)} were "
                "read")
    else:
      damage = records.record_damage(data, self._checksummed)
    if damage is not None:
      self._found_corrupt(index, records.CorruptRecord(self._shards[shard], i, damage))
      return None
    if len(data) <= self._cache_bytes:
      with self._lock:
        self._cache[index] = data
        self._cached += len(data)
        while self._cached > self._cache_bytes:
          self._cached -= len(self._cache.popitem(last=False)[1])
    return data

  def _found_corrupt(self, index: int, found: records.CorruptRecord) -> None:
    """Raises the one-line error of a corrupt record, or (skipping) records it."""
    if not self._skip_corrupt:
      raise CorpusError(f"{found.shard}: record {found.index} is corrupt ({found.reason}); "
                        "rebuild the dataset, or set data.corrupt_records=skip to train on "
                        "without it")
    with self._lock:
      self._corrupt[index] = found
      every = len(self._corrupt) == len(self)
    if every:  # nothing left to read: the loader would look for a readable record forever
      raise CorpusError(f"{found.shard}: every one of the {len(self)} records of its source's "
                        f"{len(self._shards)} shards is corrupt ({found.reason}); rebuild the "
                        "dataset")

  def corrupt_records(self) -> list[records.CorruptRecord]:
    """The corrupt records skipped so far in this process, in the order found."""
    with self._lock:
      return list(self._corrupt.values())

  def close(self) -> None:
    with self._lock:
      for handle in self._files.values():
        if isinstance(handle, int):
          os.close(handle)
      self._files.clear()

  def __del__(self) -> None:
    try:
      self.close()
    except Exception:  # interpreter shutdown: the fds go with the process
      pass


def open_records(dataset: records.BuiltDataset, source: str, split: str) -> Any:
  """Random access to the records of one source's split (all its shards, in order); one reader
  per dataset, source and split (its offsets read once, its cache shared), checking records as
  the dataset's format allows and skipping corrupt ones where `dataset.skip_corrupt`."""
  if (source, split) not in dataset.readers:
    shards = dataset.shard_paths(source, split)
    dataset.readers[source, split] = (
        ShardRecords(shards, checksummed=dataset.checksummed,
                     skip_corrupt=dataset.skip_corrupt) if dataset.format_version >= 4 else
        grain.sources.ArrayRecordDataSource([os.fspath(p) for p in shards]))
  return dataset.readers[source, split]
