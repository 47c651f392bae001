"""Mixing a built dataset's sources (the loader's arithmetic, bertjax.data.pipeline): their
weights (the dataset's, or `data.weights`), each source's share of an epoch's documents
(`mixture`: `epoch_documents` apportioned by weight with largest remainders, so a source is
down- or up-sampled), and the map from a position of the global document order to the document
of a source's stream that fills it (`MixtureElements`). The arithmetic is exact (integers and
fractions), so every host agrees.
"""

from __future__ import annotations

import bisect
import dataclasses
import fractions
import logging
import math
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from bertjax.data import records, shards
from bertjax.data.errors import CorpusError
from bertjax.data.packing import DocumentElement

log = logging.getLogger(__name__)


def source_records(dataset: records.BuiltDataset, name: str, split: str) -> Any:
  """Random access to the records of one source's split (all its shards)."""
  return shards.open_records(dataset, name, split)


def source_token_counts(dataset: records.BuiltDataset, name: str, split: str) -> np.ndarray:
  """The token count of every document of one source's split, in `source_records`' order:
  from the counts the build wrote beside each shard, or (a dataset built before them) from
  the records' headers, read once."""
  parts = []
  reader = source_records(dataset, name, split)
  for shard, path in enumerate(dataset.shard_paths(name, split)):
    counts_path = records.token_counts_path(path)
    if dataset.format_version >= 4:
      counts, size = records.load_array(counts_path), reader.shard_size(shard)
    else:
      shard_records = grain.sources.ArrayRecordDataSource([str(path)])
      size = len(shard_records)
      if counts_path.is_file():
        counts = records.load_array(counts_path)
      else:
        log.info("%s: no token counts beside the shard (built before them): reading its %d "
                 "records' headers", path, size)
        counts = np.fromiter((records.record_token_count(shard_records[i])
                              for i in range(size)), np.int64, size)
    if len(counts) != size:
      raise CorpusError(f"{counts_path}: {len(counts)} token counts for the shard's "
                        f"{size} documents; rebuild the dataset")
    parts.append(counts.astype(np.int64))
  return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclasses.dataclass(frozen=True)
class Mixture:
  """What one epoch of a split's global document order is made of: source `numbers[j]` (its
  position in the dataset's sources), named `names[j]`, holding `sizes[j]` documents, gives
  `counts[j]` documents to every epoch, read from its own shuffled stream, which continues
  across epochs. Sources left out (weight 0) are absent."""

  names: tuple[str, ...]
  numbers: tuple[int, ...]
  sizes: tuple[int, ...]
  counts: tuple[int, ...]
  stated: bool  # weights were stated (dataset or data.weights); False: weighted by size

  @property
  def epoch_documents(self) -> int:
    return sum(self.counts)

  def describe(self) -> str:
    """One line for the log: each source's documents per epoch against its size."""
    how = "stated weights" if self.stated else "weights = sizes"
    parts = [f"{name} {count:,} ({count / size:.2f}x its {size:,})"
             for name, count, size in zip(self.names, self.counts, self.sizes)]
    return f"{self.epoch_documents:,} documents per epoch ({how}): " + ", ".join(parts)


def _parse_weights(text: str, names: list[str]) -> dict[str, float]:
  weights = {}
  for item in filter(None, (i.strip() for i in text.split(","))):
    name, _, value = item.partition("=")
    if name not in names:
      raise ValueError(f"data.weights names {name!r}; the dataset's sources are {names}")
    try:
      weight = float(value)
    except ValueError:
      weight = math.nan
    if not (math.isfinite(weight) and weight >= 0):
      raise ValueError(f"data.weights: the weight of {name!r} must be a number >= 0 (0 leaves "
                       f"the source out), got {value!r}")
    weights[name] = weight
  return weights


def _apportion(total: int, weights: Sequence[float]) -> list[int]:
  """`total` split in proportion to `weights` by largest remainders (ties: the earlier source),
  so the parts sum to `total` exactly; exact rational arithmetic, so every host agrees."""
  shares = [fractions.Fraction(w) for w in weights]
  quotas = [total * share / sum(shares) for share in shares]
  counts = [math.floor(q) for q in quotas]
  by_remainder = sorted(range(len(quotas)), key=lambda j: (counts[j] - quotas[j], j))
  for j in by_remainder[:total - sum(counts)]:
    counts[j] += 1
  return counts


def mixture(dataset: records.BuiltDataset, split: str, *, weights: str = "",
            epoch_documents: int = 0) -> Mixture:
  """The sources' shares of an epoch of `split`. Training: each source's weight is the one
  `weights` ("name=weight,...") states, else the dataset's; 0 leaves the source out. No
  weight stated for any other source: they weigh their sizes, so that an epoch is each of their
  documents once; stated for some and not for others: a ValueError. An epoch is
  `epoch_documents` documents (0: as many as the mixed sources hold), apportioned by weight.
  Eval: every document once, whatever the weights."""
  names = dataset.source_names
  stated: dict[str, float | None] = dict.fromkeys(names)
  if split == "train":
    stated = {**dataset.weights, **_parse_weights(weights, names)}
    if int(epoch_documents) < 0:
      raise ValueError(f"data.epoch_documents={epoch_documents}: must be 0 (the documents of "
                       "all mixed sources) or more")
  else:
    epoch_documents = 0
  # Weight 0 states no share, only that the source is left out.
  mixed = [name for name in names if stated[name] != 0]
  if not mixed:
    raise ValueError(f"data.weights={weights!r} leaves out every source of {dataset.root}")
  # Only the mixed sources are opened: the ones left out cost nothing at start-up.
  sizes = {name: len(source_records(dataset, name, split)) for name in mixed}
  unstated = [name for name in mixed if stated[name] is None]
  if unstated and len(unstated) < len(mixed):
    given = [name for name in mixed if stated[name] is not None]
    raise ValueError(
        f"{dataset.root}: mixing weights are stated for {given} but not for {unstated}; state "
        f"every source's (e.g. data.weights=\"{','.join(n + '=1' for n in mixed)}\") or none "
        "(each source weighted by its size)")
  for name in mixed:
    if sizes[name] == 0 and split == "train":
      raise CorpusError(f"{dataset.root}: source {name!r} has no {split} documents (leave it "
                        f"out with data.weights=\"{name}=0\")")
  mixed = [name for name in mixed if sizes[name] > 0]
  if not mixed:
    raise CorpusError(f"{dataset.root}: no {split} documents in any source")
  total = int(epoch_documents) or sum(sizes[name] for name in mixed)
  counts = _apportion(total, [sizes[name] if unstated else stated[name] for name in mixed])
  return Mixture(names=tuple(mixed), numbers=tuple(names.index(name) for name in mixed),
                 sizes=tuple(sizes[name] for name in mixed), counts=tuple(counts),
                 stated=not unstated)


class MixtureElements:
  """Maps position g of the global order, whose slot in its epoch's shuffled order is `slot`,
  to a document: slots [ends[j-1], ends[j]) of epoch e are positions e * counts[j] + 0, 1, ...
  of source j's stream. O(log sources) work and memory per document, none per epoch."""

  def __init__(self, mix: Mixture, streams: list[grain.MapDataset]):
    self._mix, self._streams = mix, streams
    self._ends = np.cumsum(mix.counts).tolist()

  def _locate(self, position: int, slot: int) -> tuple[int, int, object]:
    """(source j, position in its stream, the stream's element there)."""
    epoch = position // self._mix.epoch_documents
    j = bisect.bisect_right(self._ends, slot)
    offset = slot - (self._ends[j - 1] if j else 0)
    in_source = epoch * self._mix.counts[j] + offset
    return j, in_source, self._streams[j][in_source]

  def __call__(self, position: int, slot: int) -> tuple[int, DocumentElement] | None:
    j, in_source, element = self._locate(position, slot)
    if element is None:
      # A corrupt record skipped by its reader (bertjax.data.shards): None is how a Grain
      # dataset leaves an element out, so the position is passed over wherever it is read, the
      # same on every host and after every restore.
      return None
    index, record = element
    size = self._mix.sizes[j]
    # The epoch a document carries is its own pass through its source (BERT pairs' dupe_factor
    # copies); Grain hands the shuffled indices of later passes on as pass * size + index.
    return self._mix.numbers[j], DocumentElement(position, in_source // size, index % size,
                                                 records.decode_record(record))


class MixtureTokenCounts(MixtureElements):
  """`MixtureElements` over streams of token counts (`source_token_counts`) instead of
  records: the token count of the document at each position, nothing read."""

  def __call__(self, position: int, slot: int) -> int:
    return int(self._locate(position, slot)[2][1])
