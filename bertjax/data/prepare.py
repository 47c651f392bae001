"""The dataset a training run reads: `data.dataset`, or one built on first use into the workdir.

With `data.dataset` empty, `bertjax train` trains a SentencePiece tokenizer on `data.sources`
(vocabulary = the model's, BERT or GPT special tokens by objective) unless `data.tokenizer`
names one, and builds the sources into WORKDIR/data/dataset: what makes the tiny configs run
on the embedded Wikipedia sample with one command. Pod-scale runs build once with
`bertjax data build` and point `data.dataset` at the result.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import ml_collections

from bertjax.data import records
from bertjax.data.build import BuildOptions, build_dataset
from bertjax.data.errors import SkipCounts
from bertjax.data.sentences import split_sentences
from bertjax.data.sources import SourceSpec, parse_source, read_source
from bertjax.data.tokenizers import train_sentencepiece

log = logging.getLogger(__name__)


def parse_sources(text: str) -> list[SourceSpec]:
  """Comma-separated source specs, e.g. "wikipedia:/d/enwiki.xml.bz2@0.75,text:/books@0.25"."""
  specs = [parse_source(item.strip()) for item in text.split(",") if item.strip()]
  if not specs:
    raise ValueError("data.sources is empty; e.g. data.sources=embedded")
  return specs


def corpus_sentences(sources: list[SourceSpec], language: str = "en") -> Iterator[str]:
  """Every sentence of the sources, in order (tokenizer training input)."""
  for spec in sources:
    for doc in read_source(spec, SkipCounts()):
      for paragraph in doc.paragraphs:
        if doc.sentences_given:
          yield paragraph
        else:
          yield from split_sentences(paragraph, language)


def ensure_dataset(config: ml_collections.ConfigDict, workdir: str | Path,
                   process_count: int = 1) -> str:
  """The built dataset directory for a `data.source="corpus"` run, building it if needed."""
  if config.data.dataset:
    records.BuiltDataset.open(config.data.dataset)  # fail now, not at the first batch
    return str(config.data.dataset)
  target = Path(workdir) / "data"
  dataset_dir = target / "dataset"
  if (dataset_dir / "dataset.json").is_file() and (dataset_dir / "parts").is_dir() and any(
      (dataset_dir / "parts").iterdir()):
    return str(dataset_dir)
  if process_count > 1:
    raise ValueError("data.dataset is empty: multi-process runs read a dataset built "
                     "beforehand with `bertjax data build` (set data.dataset)")
  sources = parse_sources(config.data.sources)
  tokenizer = config.data.tokenizer
  if not tokenizer:
    style = "gpt" if config.objective == "causal_lm" else "bert"
    log.info("training a %s-style SentencePiece tokenizer (%d pieces) on %s", style,
             config.model.vocab_size, config.data.sources)
    tokenizer = str(train_sentencepiece(corpus_sentences(sources), target / "tokenizer",
                                        vocab_size=int(config.model.vocab_size),
                                        model_type="unigram", style=style))
  log.info("building %s into %s", config.data.sources, dataset_dir)
  summary = build_dataset(sources, tokenizer, dataset_dir,
                          BuildOptions(num_shards=4, eval_fraction=float(config.data.eval_fraction),
                                       num_workers=int(config.data.build_workers)))
  for line in summary.lines():
    log.info("%s", line)
  return str(dataset_dir)
