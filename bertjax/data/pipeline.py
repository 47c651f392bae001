"""The loader (`CorpusBatches`): a built dataset -> the rows of every global batch a host holds,
deterministic and checkpointable, the same whatever the number of hosts, the mesh or the loader
workers; guide: docs/data.md, 'The loader' and 'Mixtures'.

The sources' documents form one global order, shuffled anew every epoch (`document_stream`; the
shares by weight in bertjax.data.mixture). Then one stream per global batch row: row r of every
batch (B rows) is the next instance of stream r, which reads documents r, r+B, r+2B, ... of that
order. So the batch at step s is a function of the seed and s only, a process builds just the
rows its devices hold (`distributed.local_rows`), and its state, the map row -> stream state (a
few integers each), restores onto any number of processes.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import grain
import numpy as np

from bertjax.data import records
from bertjax.data.bert_instances import (
  InstanceConfig,
  InstanceStats,
  SpecialIds,
  instances_from_document,
)
from bertjax.data.errors import CorpusError
from bertjax.data.schema import SEQ2SEQ
from bertjax.data.options import LoaderConfig
from bertjax.data.balance import BalancedRows, EpochTokens, RowItems, piece_of
from bertjax.data.mixture import (
  Mixture,
  MixtureElements,
  MixtureTokenCounts,
  mixture,
  source_records,
  source_token_counts,
)
from bertjax.data.packing import (
  DocSentencesIterDataset,
  DocumentElement,
  FullSentencesIterDataset,
  GptPackIterDataset,
  PackedMlmIterDataset,
  WindowShuffleIterDataset,
)
from bertjax.data.seq2seq import (DenoisingIterDataset, SpanCorruptionIterDataset,
                                  seq2seq_config)
from bertjax.data.span_masking import ContinuationTable
from bertjax.data.tokenizers import load_tokenizer, special_ids

log = logging.getLogger(__name__)

BERT_INSTANCE_MODES = ("pairs", "full_sentences", "doc_sentences", "packed")


class _DocumentView:
  """Random access to the token sentences of one source (BERT's "random other document")."""

  def __init__(self, source: Any):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> records.LazySentences:
    return records.decode_record(self._source[index]).lazy_sentences()


class _PairInstances(grain.experimental.FlatMapTransform):
  """google-research/bert instances of one document (`instances_from_document`)."""

  def __init__(self, views: list[_DocumentView], cfg: InstanceConfig, special: SpecialIds,
               is_continuation: Callable[[int], bool], dupe_factor: int):
    self.views, self.cfg, self.special = views, cfg, special
    self.is_continuation, self.dupe_factor = is_continuation, dupe_factor
    self.max_fan_out = cfg.max_seq_length  # an upper bound Grain asks for; not a limit here

  def flat_map(self, element: tuple[int, DocumentElement]) -> list[dict[str, np.ndarray]]:
    source, doc = element
    copy = doc.epoch % self.dupe_factor if self.dupe_factor else doc.epoch
    rng = random.Random(f"{self.cfg.seed}:{doc.doc.key}:{copy}")
    view = self.views[source]
    documents = _OneDocumentPatched(view, doc.index, doc.doc.sentences())
    instances = instances_from_document(documents, doc.index, self.cfg, self.special,
                                        self.is_continuation, rng, InstanceStats())
    return [i.features(self.cfg, self.special.pad) for i in instances]


class _OneDocumentPatched:
  """A document view where the current document is already decoded (saves one read)."""

  def __init__(self, view: _DocumentView, index: int, sentences: list[list[int]]):
    self._view, self._index, self._sentences = view, index, sentences

  def __len__(self) -> int:
    return len(self._view)

  def __getitem__(self, index: int) -> list[list[int]]:
    return self._sentences if index == self._index else self._view[index]


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


def _with_index(index: int, record: bytes) -> tuple[int, bytes]:
  return index, record


# Grain's shuffle takes 32-bit seeds.
_SEED_RANGE = 2**32
# Seeds the shuffle of each epoch's slots, apart from the sources' own seeds (seed + 7919 * the
# source's number): the same seed must not drive both permutations.
_EPOCH_SEED_OFFSET = 0x9E3779B9


def document_stream(dataset: records.BuiltDataset, split: str, *, seed: int, num_epochs: int,
                    shard_index: int, shard_count: int, shuffle: bool = True,
                    weights: str = "", epoch_documents: int = 0) -> grain.MapDataset:
  """(source number, DocumentElement) of this host's share of the global document order:
  epochs of `mixture(...)` documents, each epoch's slots shuffled together (a new order every
  epoch, from the seed); `num_epochs` of them, 0: endless. `shuffle=False` reads every source
  in its stored order (eval); several sources are still interleaved by the seeded slot
  shuffle, so that any prefix holds them in proportion."""
  mix = mixture(dataset, split, weights=weights, epoch_documents=epoch_documents)
  return _documents(dataset, split, mix, seed=seed, num_epochs=num_epochs,
                    shuffle=shuffle)[shard_index::shard_count]


def _documents(dataset: records.BuiltDataset, split: str, mix: Mixture, *, seed: int,
               num_epochs: int, shuffle: bool, token_counts: bool = False) -> grain.MapDataset:
  """The whole global document order of `mix` (`document_stream`'s, before a host's share);
  `token_counts`: the same order's token counts instead of its documents, nothing read."""
  streams = []
  for number in mix.numbers:
    name = dataset.source_names[number]
    stream = grain.MapDataset.source(source_token_counts(dataset, name, split) if token_counts
                                     else source_records(dataset, name, split))
    stream = stream.map_with_index(_with_index)
    if shuffle:
      # Grain's shuffle reseeds each pass (seed + pass), read past the end: a new order each.
      stream = stream.shuffle(seed=(seed + 7919 * number) % _SEED_RANGE)
    streams.append(stream.repeat())
  slots = grain.MapDataset.range(mix.epoch_documents)
  if len(streams) > 1:
    # One source needs no slot shuffle (its own stream is shuffled): the order single-source
    # runs have always had.
    slots = slots.shuffle(seed=(seed + _EPOCH_SEED_OFFSET) % _SEED_RANGE)
  elements = (MixtureTokenCounts if token_counts else MixtureElements)(mix, streams)
  return slots.repeat(num_epochs or None).map_with_index(elements)


def bert_special_ids(tokenizer) -> SpecialIds:
  ids = special_ids(tokenizer)
  missing = [k for k in ("pad", "cls", "sep", "mask") if ids.get(k) is None]
  if missing:
    raise CorpusError(f"the dataset's tokenizer lacks BERT special tokens: {missing}")
  return SpecialIds(pad=ids["pad"], cls=ids["cls"], sep=ids["sep"], mask=ids["mask"],
                    vocab_size=len(tokenizer))


def _drop_source(element: tuple[int, DocumentElement]) -> DocumentElement:
  return element[1]


# A row stream reads its documents one at a time, in this process: Grain's default read-ahead
# threads (16 per stream) would mean thousands of threads for a host's rows.
_NO_READ_AHEAD = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class RowStreamFactory:
  """Builds the instance stream of one global batch row (`__call__(row)`); the document order,
  tokenizer and random-access views are shared by all rows of a process. Picklable (worker
  processes rebuild the streams of their rows)."""

  def __init__(self, dataset: records.BuiltDataset, cfg: LoaderConfig, split: str,
               batch_size: int):
    training = split == "train"
    self.cfg, self.batch_size = cfg, batch_size
    self.seed = cfg.seed if training else cfg.seed + 1
    self.mixture = mixture(dataset, split, weights=cfg.weights,
                           epoch_documents=cfg.epoch_documents)
    num_epochs = cfg.num_epochs if training else 0
    self.documents = _documents(dataset, split, self.mixture, seed=self.seed,
                                num_epochs=num_epochs, shuffle=training)
    self.balanced = None
    if training and cfg.row_balance == "tokens":
      counts = _documents(dataset, split, self.mixture, seed=self.seed, num_epochs=num_epochs,
                          shuffle=training, token_counts=True)
      n = self.mixture.epoch_documents
      self.balanced = BalancedRows(EpochTokens(counts, n), n, batch_size, num_epochs,
                                   min_piece=2 * cfg.seq_length, weigh=self._weigh)
    tokenizer = dataset_tokenizer(dataset)
    if cfg.objective in SEQ2SEQ:
      self.seq2seq = seq2seq_config(tokenizer, cfg, self.seed)
      self.continuation = ContinuationTable.of(tokenizer.is_continuation, len(tokenizer))
      return
    if cfg.objective == "causal_lm":
      self.eot = special_ids(tokenizer).get("eot")
      if self.eot is None:
        raise CorpusError(f"{dataset.tokenizer_dir}: GPT packing needs an end-of-text token")
      return
    if cfg.bert_instances not in BERT_INSTANCE_MODES:
      raise ValueError(f"data.bert_instances={cfg.bert_instances!r}; choose from "
                       f"{BERT_INSTANCE_MODES}")
    self.special = bert_special_ids(tokenizer)
    self.instance_cfg = InstanceConfig(
        max_seq_length=cfg.seq_length, max_predictions=cfg.max_predictions,
        masked_lm_prob=cfg.mask_prob, mask_token_prob=cfg.mask_token_prob,
        random_token_prob=cfg.random_token_prob, short_seq_prob=cfg.short_seq_prob,
        dupe_factor=cfg.dupe_factor, whole_word_mask=cfg.whole_word_mask, seed=self.seed,
        masking=cfg.masking, ngram_max=cfg.ngram_max, span_geometric_p=cfg.span_geometric_p,
        span_max_length=cfg.span_max_length, span_boundary=cfg.objective == "mlm_sbo")
    # Whole words (whole-word, n-gram and span masking) from a table over the vocabulary, read
    # once here: a WordPiece tokenizer's is_continuation decodes the piece at every call.
    whole_words = cfg.whole_word_mask or cfg.masking != "token"
    self.continuation = (ContinuationTable.of(tokenizer.is_continuation, len(tokenizer))
                         if whole_words else _never)
    # Views of the mixed sources only (indexed by source number): the others are not opened.
    self.views = [_DocumentView(source_records(dataset, name, split))
                  if number in self.mixture.numbers else None
                  for number, name in enumerate(dataset.source_names)]

  def _weigh(self, positions: np.ndarray, piece: np.ndarray, pieces: np.ndarray,
             tokens: np.ndarray) -> np.ndarray:
    """What each item (a document or a piece of one, `tokens` long) costs the row reading
    it: its tokens and a separator in token streams (GPT, FULL-SENTENCES, packed rows); its
    instances where a document makes its own sequences (BERT pairs, DOC-SENTENCES), counted
    by making them: an estimate from the length misses by about one in two documents, which
    leaves rows of a few dozen documents 5% apart."""
    if self.cfg.objective in ("causal_lm", *SEQ2SEQ) or self.cfg.bert_instances in (
        "full_sentences", "packed"):
      return np.asarray(tokens, np.int64) + 1
    if self.cfg.bert_instances == "doc_sentences":
      def sequences(number: int, element: DocumentElement) -> int:
        one = grain.MapDataset.source([element]).to_iter_dataset(_NO_READ_AHEAD)
        return sum(1 for _ in DocSentencesIterDataset(one, self.instance_cfg, self.special,
                                                      self.continuation, self.seed))
    else:
      pairs = _PairInstances(self.views, self.instance_cfg, self.special, self.continuation,
                             self.cfg.dupe_factor)

      def sequences(number: int, element: DocumentElement) -> int:
        return len(pairs.flat_map((number, element)))
    out = np.empty(len(positions), np.int64)
    for i, (position, k, count) in enumerate(zip(positions.tolist(), piece.tolist(),
                                                  pieces.tolist())):
      number, element = self.documents[position]
      out[i] = sequences(number, piece_of(element, k, count) if count > 1 else element)
    return out

  def documents_of(self, row: int) -> grain.MapDataset:
    """(source number, DocumentElement) of row `row`: documents row, row+B, ... of the global
    order, or with token-balanced rows the documents dealt to it (bertjax.data.balance)."""
    if self.balanced is None:
      return self.documents[row::self.batch_size]
    count = self.balanced.items_of_row(row)
    return grain.MapDataset.range(sys.maxsize if count is None else count).map(
        RowItems(self.documents, self.balanced, row))

  def __call__(self, row: int) -> grain.IterDataset:
    docs = self.documents_of(row)
    if self.cfg.objective == "span_corruption":
      return SpanCorruptionIterDataset(docs.map(_drop_source).to_iter_dataset(_NO_READ_AHEAD),
                                       self.seq2seq)
    if self.cfg.objective == "denoising":
      return DenoisingIterDataset(docs.map(_drop_source).to_iter_dataset(_NO_READ_AHEAD),
                                  self.seq2seq, self.continuation)
    if self.cfg.objective == "causal_lm":
      return GptPackIterDataset(docs.map(_drop_source).to_iter_dataset(_NO_READ_AHEAD),
                                self.cfg.seq_length, self.eot)
    if self.cfg.bert_instances in ("full_sentences", "doc_sentences"):
      packer = (FullSentencesIterDataset if self.cfg.bert_instances == "full_sentences"
                else DocSentencesIterDataset)
      return packer(docs.map(_drop_source).to_iter_dataset(_NO_READ_AHEAD), self.instance_cfg,
                    self.special, self.continuation, self.seed)
    if self.cfg.bert_instances == "packed":
      return PackedMlmIterDataset(docs.map(_drop_source).to_iter_dataset(_NO_READ_AHEAD),
                                  self.instance_cfg, self.special, self.continuation, self.seed)
    instances = grain.experimental.FlatMapIterDataset(
        docs.to_iter_dataset(_NO_READ_AHEAD),
        _PairInstances(self.views, self.instance_cfg, self.special, self.continuation,
                       self.cfg.dupe_factor))
    if self.cfg.shuffle_window > 1:
      instances = WindowShuffleIterDataset(instances, self.cfg.shuffle_window,
                                           (self.seed, row))
    return instances


def instance_dataset(dataset: records.BuiltDataset, cfg: LoaderConfig, split: str,
                     row: int = 0, batch_size: int = 1) -> grain.IterDataset:
  """The single examples (feature dicts) of global batch row `row` of `batch_size`; with the
  defaults, every instance of the whole document order in one stream."""
  return RowStreamFactory(dataset, cfg, split, batch_size)(row)


class RowStreams(grain.IterDataset):
  """The row streams of some global batch rows; each element holds the next instance of every
  one of them. Grain's `mp_prefetch` gives each worker process a slice of the rows
  (`set_slice`), so workers never change what a row receives."""

  def __init__(self, make_stream: Callable[[int], grain.IterDataset], rows: Sequence[int],
               states: Mapping[int, Any] | None = None):
    super().__init__()
    self._make_stream, self._rows, self._states = make_stream, tuple(rows), dict(states or {})

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    del sequential_slice  # rows are independent streams: any slice is equivalent
    self._rows = self._rows[sl]

  def __iter__(self) -> "_RowStreamsIterator":
    return _RowStreamsIterator(self._make_stream, self._rows, self._states)


class _RowStreamsIterator(grain.DatasetIterator):
  """Elements: {"rows", "features" (stacked in row order), "states" (each stream's state after
  it), "exhausted"}. A finite stream that runs out makes every later element `exhausted`."""

  def __init__(self, make_stream: Callable[[int], grain.IterDataset], rows: tuple[int, ...],
               states: Mapping[int, Any]):
    super().__init__()
    self._rows = rows
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
      return {"rows": rows, "features": {}, "states": {}, "exhausted": True}
    features = ({k: np.stack([e[k] for e in examples]) for k in examples[0]}
                if examples else {})
    return {"rows": rows, "features": features, "exhausted": False,
            "states": {row: it.get_state() for row, it in zip(self._rows, self._iterators)}}

  def get_state(self) -> dict[str, Any]:
    return {str(row): it.get_state() for row, it in zip(self._rows, self._iterators)}

  def set_state(self, state: dict[str, Any]) -> None:
    for row, it in zip(self._rows, self._iterators):
      it.set_state(state[str(row)])
    self._exhausted = False


def _never(_: int) -> bool:
  return False


def dataset_tokenizer(dataset: records.BuiltDataset):
  directory = dataset.tokenizer_dir  # a local copy of a remote dataset's: looked up once
  config_path = directory / "bertjax_tokenizer.json"
  lowercase = None
  if config_path.is_file():
    lowercase = json.loads(config_path.read_text()).get("lowercase")
  return load_tokenizer(directory, lowercase=lowercase)


class BatchIterator(Protocol):
  def __next__(self) -> dict[str, np.ndarray]: ...
  def get_state(self) -> dict[str, Any]: ...
  def set_state(self, state: dict[str, Any]) -> None: ...


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
    dataset = records.BuiltDataset.open(cfg.dataset)
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

  def _open(self) -> None:
    ds = RowStreams(self._factory, self._rows, self._states)
    if self._workers > 0:
      # Grain's workers read absl flags; a program that is not an absl app has not parsed them.
      from absl import flags
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
