"""The row streams of the loader: the global document order (`document_stream`) and, per global
batch row, the stream of single examples each objective makes from its documents
(`RowStreamFactory`: BERT pairs, FULL-/DOC-SENTENCES, packed MLM rows, GPT packing, T5 and BART
examples) before bertjax.data.pipeline stacks the rows into batches; guide: docs/data.md, 'The
loader'.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from bertjax.data import records
from bertjax.data.balance import BalancedRows, EpochTokens, RowItems, piece_of
from bertjax.data.bert_instances import (
  InstanceConfig,
  InstanceStats,
  SpecialIds,
  instances_from_document,
)
from bertjax.data.errors import CorpusError
from bertjax.data.mixture import (
  Mixture,
  MixtureElements,
  MixtureTokenCounts,
  mixture,
  source_records,
  source_token_counts,
)
from bertjax.data.options import LoaderConfig
from bertjax.data.packing import (
  DocSentencesIterDataset,
  DocumentElement,
  FullSentencesIterDataset,
  GptPackIterDataset,
  PackedMlmIterDataset,
  WindowShuffleIterDataset,
)
from bertjax.data.schema import objective
from bertjax.data.seq2seq import DenoisingIterDataset, SpanCorruptionIterDataset, seq2seq_config
from bertjax.data.shards import ShardRecords
from bertjax.data.span_masking import ContinuationTable
from bertjax.data.tokenizers import load_tokenizer, special_ids

BERT_INSTANCE_MODES = ("pairs", "full_sentences", "doc_sentences", "packed")


class _DocumentView:
  """Random access to the token sentences of one source (BERT's "random other document"); None
  for a corrupt record skipped (bert_instances draws another)."""

  def __init__(self, source: Any):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> records.LazySentences | None:
    record = self._source[index]
    return None if record is None else records.decode_record(record).lazy_sentences()


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

  def __getitem__(self, index: int) -> list[list[int]] | records.LazySentences | None:
    return self._sentences if index == self._index else self._view[index]


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
    self.objective = objective(cfg.objective)
    self.seed = cfg.seed if training else cfg.seed + 1
    self.mixture = mixture(dataset, split, weights=cfg.weights,
                           epoch_documents=cfg.epoch_documents)
    # The mixed sources' readers, the ones the document order reads through.
    self.readers = [source_records(dataset, dataset.source_names[number], split)
                    for number in self.mixture.numbers]
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
    if self.objective.noise:
      self.seq2seq = seq2seq_config(tokenizer, cfg, self.seed)
      self.continuation = ContinuationTable.of(tokenizer.is_continuation, len(tokenizer))
      return
    if self.objective.causal:
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
        span_max_length=cfg.span_max_length, span_boundary=self.objective.span_boundary)
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
    if self.objective.causal or self.objective.noise or self.cfg.bert_instances in (
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
      found = self.documents[position]
      if found is None:  # a corrupt record, skipped: its row reads nothing of it
        out[i] = 0
        continue
      number, element = found
      out[i] = sequences(number, piece_of(element, k, count) if count > 1 else element)
    return out

  def corrupt_records(self) -> list[records.CorruptRecord]:
    """The corrupt records this process (or loader worker) has skipped so far (formats 2 and
    3 are read by Grain's ArrayRecord source, which skips nothing)."""
    return [found for reader in self.readers if isinstance(reader, ShardRecords)
            for found in reader.corrupt_records()]

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
    if self.objective.noise == "spans":
      return SpanCorruptionIterDataset(docs.map(_drop_source).to_iter_dataset(_NO_READ_AHEAD),
                                       self.seq2seq)
    if self.objective.noise == "infilling":
      return DenoisingIterDataset(docs.map(_drop_source).to_iter_dataset(_NO_READ_AHEAD),
                                  self.seq2seq, self.continuation)
    if self.objective.causal:
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


def _never(_: int) -> bool:
  return False


def dataset_tokenizer(dataset: records.BuiltDataset):
  directory = dataset.tokenizer_dir  # a local copy of a remote dataset's: looked up once
  config_path = directory / "bertjax_tokenizer.json"
  lowercase = None
  if config_path.is_file():
    lowercase = json.loads(config_path.read_text()).get("lowercase")
  return load_tokenizer(directory, lowercase=lowercase)
