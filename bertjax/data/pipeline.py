"""The loader: a built dataset -> the local batches of one host, deterministic and checkpointable.

Grain pipeline, per source: ArrayRecord documents -> global shuffle (a new order each epoch,
from the seed) -> repeat -> numbered. Sources are mixed by weight; then this host takes every
`shard_count`-th document starting at `shard_index`, so hosts read disjoint shares and one
epoch yields every document exactly once whatever the number of hosts. Per host, documents
become instances (BERT pairs, RoBERTa full sentences, or GPT packed windows), are batched to
the host's rows of the global batch, and are prepared by worker processes ahead of the step.

Every stage is a Grain iterator whose state is a few integers (the parent's position plus an
offset), so `get_state()` after k batches and `set_state()` in a fresh process continue with
exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from typing import Any, Callable, Iterator, Protocol

import grain
import numpy as np

from bertjax.data import records
from bertjax.data.bert_instances import (InstanceConfig, InstanceStats, SpecialIds,
                                         instances_from_document)
from bertjax.data.errors import CorpusError
from bertjax.data.packing import (DocumentElement, FullSentencesIterDataset, GptPackIterDataset,
                                  WindowShuffleIterDataset)
from bertjax.data.tokenizers import load_tokenizer, special_ids

BERT_INSTANCE_MODES = ("pairs", "full_sentences")


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
  """What the loader needs from the run config (`data.*`, `seq_length`, `objective`)."""

  dataset: str
  objective: str  # mlm_nsp | mlm | mlm_sop | causal_lm
  seq_length: int
  max_predictions: int = 20
  mask_prob: float = 0.15
  # BERT: "pairs" (google-research/bert instances: A/B segments, NSP labels) or
  # "full_sentences" (RoBERTa FULL-SENTENCES: no pairs, packed across documents).
  bert_instances: str = "pairs"
  short_seq_prob: float = 0.1
  # Pairs: epochs e and e + dupe_factor see the same instances (google-research/bert's static
  # copies); 0: new instances and masks every epoch (dynamic masking).
  dupe_factor: int = 10
  whole_word_mask: bool = False
  seed: int = 0
  num_epochs: int = 0  # 0: repeat forever
  # Instances of one document are consecutive; shuffle them in a window of this many.
  shuffle_window: int = 1024
  num_workers: int = 0
  prefetch: int = 2
  # "name=weight,..." overrides the mixing weights the dataset was built with.
  weights: str = ""


class _DocumentView:
  """Random access to the token sentences of one source (BERT's "random other document")."""

  def __init__(self, source: grain.sources.ArrayRecordDataSource):
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


def _with_index(index: int, record: bytes) -> tuple[int, bytes]:
  return index, record


def _element(num_documents: int, source: int, ordinal: int,
             item: tuple[int, bytes]) -> tuple[int, DocumentElement]:
  index, record = item
  # Grain hands indices of later epochs to the parent as epoch * n + i.
  return source, DocumentElement(ordinal, ordinal // num_documents, index % num_documents,
                                 records.decode_record(record))


def _parse_weights(text: str, names: list[str]) -> dict[str, float]:
  weights = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    if name not in names:
      raise ValueError(f"data.weights names {name!r}; the dataset's sources are {names}")
    weights[name] = float(value)
  return weights


def document_stream(dataset: records.BuiltDataset, split: str, *, seed: int, num_epochs: int,
                    shard_index: int, shard_count: int, shuffle: bool = True,
                    weights: str = "") -> grain.MapDataset:
  """(source number, DocumentElement) of this host's share, in global-shuffle order."""
  names = dataset.source_names
  mixing = {**dataset.weights, **_parse_weights(weights, names)}
  streams, stream_weights = [], []
  for number, name in enumerate(names):
    source = grain.sources.ArrayRecordDataSource([str(p) for p in
                                                  dataset.shard_paths(name, split)])
    n = len(source)
    if n == 0:
      if mixing[name] > 0 and split == "train":
        raise CorpusError(f"{dataset.root}: source {name!r} has no {split} documents")
      continue
    ds = grain.MapDataset.source(source).map_with_index(_with_index)
    if shuffle:
      ds = ds.shuffle(seed=seed + 7919 * number)
    ds = ds.repeat(num_epochs or None)
    streams.append(ds.map_with_index(functools.partial(_element, n, number)))
    stream_weights.append(mixing[name])
  if not streams:
    raise CorpusError(f"{dataset.root}: no {split} documents in any source")
  mixed = streams[0] if len(streams) == 1 else grain.MapDataset.mix(streams, stream_weights)
  return mixed[shard_index::shard_count]


def bert_special_ids(tokenizer) -> SpecialIds:
  ids = special_ids(tokenizer)
  missing = [k for k in ("pad", "cls", "sep", "mask") if ids.get(k) is None]
  if missing:
    raise CorpusError(f"the dataset's tokenizer lacks BERT special tokens: {missing}")
  return SpecialIds(pad=ids["pad"], cls=ids["cls"], sep=ids["sep"], mask=ids["mask"],
                    vocab_size=len(tokenizer))


def _drop_source(element: tuple[int, DocumentElement]) -> DocumentElement:
  return element[1]


def instance_dataset(dataset: records.BuiltDataset, cfg: LoaderConfig, split: str,
                     shard_index: int, shard_count: int) -> grain.IterDataset:
  """This host's stream of single examples (feature dicts) for `cfg.objective`."""
  training = split == "train"
  seed = cfg.seed if training else cfg.seed + 1
  docs = document_stream(dataset, split, seed=seed,
                         num_epochs=cfg.num_epochs if training else 0,
                         shard_index=shard_index, shard_count=shard_count,
                         shuffle=training, weights=cfg.weights)
  tokenizer = dataset_tokenizer(dataset)
  if cfg.objective == "causal_lm":
    eot = special_ids(tokenizer).get("eot")
    if eot is None:
      raise CorpusError(f"{dataset.tokenizer_dir}: GPT packing needs an end-of-text token")
    return GptPackIterDataset(docs.map(_drop_source).to_iter_dataset(), cfg.seq_length, eot)
  special = bert_special_ids(tokenizer)
  instance_cfg = InstanceConfig(max_seq_length=cfg.seq_length,
                                max_predictions=cfg.max_predictions,
                                masked_lm_prob=cfg.mask_prob, short_seq_prob=cfg.short_seq_prob,
                                dupe_factor=cfg.dupe_factor,
                                whole_word_mask=cfg.whole_word_mask, seed=seed)
  continuation = tokenizer.is_continuation if cfg.whole_word_mask else _never
  if cfg.bert_instances == "full_sentences":
    return FullSentencesIterDataset(docs.map(_drop_source).to_iter_dataset(), instance_cfg,
                                    special, continuation, seed)
  if cfg.bert_instances != "pairs":
    raise ValueError(f"data.bert_instances={cfg.bert_instances!r}; choose from "
                     f"{BERT_INSTANCE_MODES}")
  views = [_DocumentView(grain.sources.ArrayRecordDataSource(
      [str(p) for p in dataset.shard_paths(name, split)])) for name in dataset.source_names]
  instances = grain.experimental.FlatMapIterDataset(
      docs.to_iter_dataset(), _PairInstances(views, instance_cfg, special, continuation,
                                             cfg.dupe_factor))
  if cfg.shuffle_window > 1:
    instances = WindowShuffleIterDataset(instances, cfg.shuffle_window, seed)
  return instances


def _never(_: int) -> bool:
  return False


def dataset_tokenizer(dataset: records.BuiltDataset):
  config_path = dataset.tokenizer_dir / "bertjax_tokenizer.json"
  lowercase = None
  if config_path.is_file():
    lowercase = json.loads(config_path.read_text()).get("lowercase")
  return load_tokenizer(dataset.tokenizer_dir, lowercase=lowercase)


class BatchIterator(Protocol):
  def __next__(self) -> dict[str, np.ndarray]: ...
  def get_state(self) -> dict[str, Any]: ...
  def set_state(self, state: dict[str, Any]) -> None: ...


class CorpusBatches:
  """Local batches of a built dataset for one host; `get_state`/`set_state` are exact."""

  def __init__(self, cfg: LoaderConfig, split: str, local_batch_size: int, shard_index: int,
               shard_count: int):
    dataset = records.BuiltDataset.open(cfg.dataset)
    ds = instance_dataset(dataset, cfg, split, shard_index, shard_count)
    ds = ds.batch(local_batch_size, drop_remainder=True)
    if cfg.num_workers > 0:
      # Grain's workers read absl flags; a program that is not an absl app has not parsed them.
      from absl import flags
      if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(
          num_workers=cfg.num_workers, per_worker_buffer_size=max(1, cfg.prefetch)))
    elif cfg.prefetch > 0:
      ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cfg.prefetch)
    self._iterator = iter(ds)

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def get_state(self) -> dict[str, Any]:
    return self._iterator.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._iterator.set_state(state)

  def close(self) -> None:
    close = getattr(self._iterator, "close", None)
    if close is not None:
      close()
