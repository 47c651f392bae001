"""The loader (`CorpusBatches`): a built dataset -> the rows of every global batch a host holds,
deterministic and checkpointable, the same whatever the number of hosts, the mesh or the loader
workers. Row r of every batch is the next instance of row stream r (bertjax/data/streams.py),
so a process builds only the rows its devices hold and its state restores onto any number of
processes. The guide: docs/data.md, 'The loader' and 'Mixtures'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grain
import numpy as np
from absl import flags

from bertjax.data import records
from bertjax.data.errors import CorpusError
from bertjax.data.mixture import source_records
from bertjax.data.options import LoaderConfig
from bertjax.data.streams import RowStreamFactory

log = logging.getLogger(__name__)

# Corrupt records logged one line each; past these a dataset wants rebuilding, not reading.
_CORRUPT_LOGGED = 200


def split_documents(dataset: records.BuiltDataset, split: str) -> int:
  """Documents of `split` in all sources of the dataset (from the shards themselves)."""
  return sum(len(source_records(dataset, name, split)) for name in dataset.source_names)


def check_eval_split(dataset: records.BuiltDataset) -> None:
  """Raises CorpusError (one line) when the dataset holds out no eval documents."""
  if split_documents(dataset, "eval") == 0:
    raise CorpusError(
        f"{dataset.root}: no eval documents (eval_fraction {dataset.meta.get('eval_fraction')} "
        f"of {split_documents(dataset, 'train')} documents held out none); rebuild with a "
        "larger --eval-fraction (data.eval_fraction when built on first use) or set "
        "eval_every=0")


class RowStreams(grain.IterDataset):
  """The row streams of some global batch rows; each element holds the next instance of every
  one of them. Grain's `mp_prefetch` gives each worker process a slice of the rows
  (`set_slice`), so workers never change what a row receives. `corrupt_records`: what the
  process running the streams has skipped (RowStreamFactory.corrupt_records), handed on with
  the elements, as a worker's readers are in the worker."""

  def __init__(self, make_stream: Callable[[int], grain.IterDataset], rows: Sequence[int],
               states: Mapping[int, Any] | None = None,
               corrupt_records: Callable[[], list[records.CorruptRecord]] | None = None):
    super().__init__()
    self._make_stream, self._rows, self._states = make_stream, tuple(rows), dict(states or {})
    self._corrupt_records = corrupt_records

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    del sequential_slice  # rows are independent streams: any slice is equivalent
    self._rows = self._rows[sl]

  def __iter__(self) -> _RowStreamsIterator:
    return _RowStreamsIterator(self._make_stream, self._rows, self._states,
                               self._corrupt_records)


class _RowStreamsIterator(grain.DatasetIterator):
  """Elements: {"rows", "features" (stacked in row order), "states" (each stream's state after
  it), "exhausted", "corrupt" (the corrupt records skipped since the last element)}. A finite
  stream that runs out makes every later element `exhausted`."""

  def __init__(self, make_stream: Callable[[int], grain.IterDataset], rows: tuple[int, ...],
               states: Mapping[int, Any],
               corrupt_records: Callable[[], list[records.CorruptRecord]] | None = None):
    super().__init__()
    self._rows = rows
    self._corrupt_records = corrupt_records
    self._reported: set[records.CorruptRecord] = set()
    self._iterators = []
    for row in rows:
      iterator = make_stream(row).__iter__()
      if states.get(row) is not None:
        iterator.set_state(states[row])
      self._iterators.append(iterator)
    self._exhausted = False

  def __next__(self) -> dict[str, Any]:
    rows = np.asarray(self._rows, np.int64)
    if not self._exhausted:
      try:
        examples = [next(it) for it in self._iterators]
      except StopIteration:
        self._exhausted = True
    if self._exhausted:
      return {"rows": rows, "features": {}, "states": {}, "exhausted": True,
              "corrupt": self._newly_corrupt()}
    features = ({k: np.stack([e[k] for e in examples]) for k in examples[0]}
                if examples else {})
    return {"rows": rows, "features": features, "exhausted": False,
            "states": {row: it.get_state() for row, it in zip(self._rows, self._iterators)},
            "corrupt": self._newly_corrupt()}

  def _newly_corrupt(self) -> list[records.CorruptRecord]:
    found = self._corrupt_records() if self._corrupt_records is not None else []
    new = [c for c in found if c not in self._reported]
    self._reported.update(new)
    return new

  def get_state(self) -> dict[str, Any]:
    return {str(row): it.get_state() for row, it in zip(self._rows, self._iterators)}

  def set_state(self, state: dict[str, Any]) -> None:
    for row, it in zip(self._rows, self._iterators):
      it.set_state(state[str(row)])
    self._exhausted = False


class CorpusBatches:
  """The rows `rows` (ascending) of every global batch of `batch_size` rows, from a built
  dataset; `get_state`/`set_state` are exact and independent of the process layout. Raises
  StopIteration at the first batch some row cannot fill (finite `num_epochs`)."""

  def __init__(self, cfg: LoaderConfig, split: str, rows: Sequence[int], batch_size: int):
    self._cfg, self._rows, self._batch_size = cfg, tuple(rows), int(batch_size)
    if list(self._rows) != sorted(set(self._rows)) or not self._rows or (
        self._rows[0] < 0 or self._rows[-1] >= self._batch_size):
      raise ValueError(f"rows must be distinct, ascending and within the batch of "
                       f"{batch_size}; got {len(self._rows)} rows from {self._rows[:1]}")
    self._position = {row: i for i, row in enumerate(self._rows)}
    dataset = records.BuiltDataset.open(cfg.dataset, skip_corrupt=cfg.corrupt_records == "skip")
    if cfg.require_eval and split == "train":
      check_eval_split(dataset)
    self._factory = RowStreamFactory(dataset, cfg, split, self._batch_size)
    if split == "train" and len(dataset.source_names) > 1:
      log.info("data mixture: %s", self._factory.mixture.describe())
    if split == "train" and cfg.num_epochs and cfg.row_balance == "documents":
      log.info("data.num_epochs=%d with rows dealt documents in turn: the run ends when the row "
               "with the least to read runs out; data.row_balance=tokens delivers nearly all "
               "(docs/data.md, 'Balanced epochs')", cfg.num_epochs)
    # Each row's stream state after the last batch handed out (None: not started).
    self._states: dict[int, Any] = {row: None for row in self._rows}
    self._workers = max(0, min(int(cfg.num_workers), len(self._rows)))
    self._iterator = None  # opened on first use, so a restore does not start workers twice
    # The corrupt records skipped by this process's loader (its workers' included), in the
    # order they were found.
    self._corrupt: dict[tuple[str, int], records.CorruptRecord] = {}

  @property
  def corrupt_records(self) -> int:
    """How many corrupt records this process's loader has skipped (each once, however often
    read), also those of batches read ahead."""
    return len(self._corrupt)

  @property
  def corrupt_found(self) -> list[records.CorruptRecord]:
    """Those records (shard file, index, reason), in the order they were found."""
    return list(self._corrupt.values())

  def _note_corrupt(self, found: Sequence[records.CorruptRecord]) -> None:
    """One line per corrupt record newly skipped, naming it (the first few hundred)."""
    for record in found:
      if (record.shard, record.index) in self._corrupt:
        continue
      self._corrupt[record.shard, record.index] = record
      n = len(self._corrupt)
      if n <= _CORRUPT_LOGGED:
        log.warning("%s: record %d is corrupt (%s): skipped, never trained on "
                    "(data.corrupt_records=skip); %d corrupt record(s) skipped by this "
                    "process", record.shard, record.index, record.reason, n)
      if n == _CORRUPT_LOGGED:
        log.warning("further corrupt records are skipped and counted, not logged: rebuild "
                    "the dataset")

  def _open(self) -> None:
    ds = RowStreams(self._factory, self._rows, self._states, self._factory.corrupt_records)
    if self._workers > 0:
      # Grain's workers read absl flags; a program that is not an absl app has not parsed them.
      if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(
          num_workers=self._workers, per_worker_buffer_size=max(1, self._cfg.prefetch)))
    elif self._cfg.prefetch > 0:
      ds = grain.experimental.ThreadPrefetchIterDataset(ds,
                                                        prefetch_buffer_size=self._cfg.prefetch)
    self._iterator = iter(ds)

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._iterator is None:
      self._open()
    # Workers take turns (Grain interleaves them in order): one part of the rows each.
    parts = [next(self._iterator) for _ in range(max(1, self._workers))]
    for part in parts:
      self._note_corrupt(part["corrupt"])
    if any(part["exhausted"] for part in parts):
      raise StopIteration
    batch: dict[str, np.ndarray] = {}
    filled = np.zeros(len(self._rows), bool)
    for part in parts:
      if not len(part["rows"]):
        continue
      index = [self._position[int(r)] for r in part["rows"]]
      filled[index] = True
      for key, value in part["features"].items():
        if key not in batch:
          batch[key] = np.empty((len(self._rows),) + value.shape[1:], value.dtype)
        batch[key][index] = value
      self._states.update(part["states"])
    if not filled.all():
      raise RuntimeError(f"the loader produced {int(filled.sum())} of this process's "
                         f"{len(self._rows)} rows")
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"batch_size": self._batch_size,
            "rows": {str(row): state for row, state in self._states.items()}}

  def set_state(self, state: dict[str, Any]) -> None:
    """Positions this iterator's rows from a state holding them (any process layout's)."""
    if "rows" not in state:
      raise ValueError("the saved data state has no row streams: it was written by an older "
                       "bertjax whose data order depended on the process count, and cannot "
                       "be continued exactly")
    if int(state.get("batch_size", -1)) != self._batch_size:
      raise ValueError(f"the saved data state is for global batches of "
                       f"{state.get('batch_size')} rows; this run's batch_size is "
                       f"{self._batch_size}")
    missing = [row for row in self._rows if str(row) not in state["rows"]]
    if missing:
      raise ValueError(f"the saved data state lacks {len(missing)} of this process's rows "
                       f"(e.g. row {missing[0]}): a process's state file is missing")
    self.close()
    self._states = {row: state["rows"][str(row)] for row in self._rows}

  def close(self) -> None:
    close = getattr(self._iterator, "close", None)
    if close is not None:
      close()
    self._iterator = None


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """One state from the states every process saved: row streams are united (each process
  saved its own rows); any other state must be the same on every process."""
  if not states:
    raise ValueError("no data state was saved")
  if all("rows" in s for s in states):
    sizes = {s.get("batch_size") for s in states}
    if len(sizes) > 1:
      raise ValueError(f"processes saved data states for different batch sizes {sizes}")
    rows: dict[str, Any] = {}
    for s in states:
      rows.update(s["rows"])
    return {**states[0], "rows": rows}
  if any(s != states[0] for s in states[1:]):
    raise ValueError("processes saved different data states")
  return states[0]
