"""The dataset a training run reads: `data.dataset`, or one built on first use into the workdir.

With `data.dataset` empty, `bertjax train` trains a SentencePiece tokenizer on `data.sources`
(vocabulary = the model's, BERT or GPT special tokens by objective) unless `data.tokenizer`
names one, and builds the sources into WORKDIR/data/dataset: what makes the tiny configs run
on the embedded Wikipedia sample with one command. Pod-scale runs build once with
`bertjax data build` and point `data.dataset` at the result.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import ml_collections

from bertjax import paths
from bertjax.data import records
from bertjax.data.build import build_dataset
from bertjax.data.errors import SkipCounts
from bertjax.data.options import BuildOptions
from bertjax.data.sentencepiece_training import appended_pieces, train_sentencepiece
from bertjax.data.sentences import check_language, split_sentences
from bertjax.data.sources import SourceSpec, parse_sources, read_source
from bertjax.data.tokenizers import MODEL_FILE, load_tokenizer, recorded_lowercase
from bertjax.models import families

log = logging.getLogger(__name__)


def corpus_sentences(sources: list[SourceSpec], language: str = "en") -> Iterator[str]:
  """Every sentence of the sources, in order (tokenizer training input); each source's
  paragraphs are split with its own `language`, `language` for those that state none. Every
  source's language is checked here, at the call, before any source is read (ValueError: see
  `sentences.check_language`)."""
  languages = [check_language(spec.language or language) for spec in sources]
  return _sentences(sources, languages)


def _sentences(sources: list[SourceSpec], languages: list[str]) -> Iterator[str]:
  for spec, language in zip(sources, languages, strict=True):
    for doc in read_source(spec, SkipCounts()):
      for paragraph in doc.paragraphs:
        if doc.sentences_given:
          yield paragraph
        else:
          yield from split_sentences(paragraph, language)


def build_lowercase(value: str | bool, tokenizer: str) -> bool:
  """`data.lowercase` ("true", "false" or "": the default) for a build with `tokenizer` (a
  vocab.txt or SentencePiece directory; empty: one trained for the build)."""
  text = str(value).strip().lower()
  if text not in ("true", "1", "yes", "false", "0", "no", "", "none"):
    raise ValueError(f"data.lowercase={value!r}: expected true, false or empty (the default)")
  asked = None if text in ("", "none") else text in ("true", "1", "yes")
  if not tokenizer:
    return bool(asked)  # a trained SentencePiece keeps case unless asked
  local = paths.local_copy(tokenizer)
  directory = local.parent if local.is_file() else local
  if local.suffix == ".model" or (directory / MODEL_FILE).is_file():
    # A SentencePiece model's casing was fixed when it was trained; a flag cannot change it.
    folds = load_tokenizer(local).lowercase
    if asked is not None and asked != folds:
      raise ValueError(f"data.lowercase={value} but data.tokenizer={tokenizer} is a "
                       f"{'lower-casing' if folds else 'cased'} SentencePiece model; train one "
                       f"with{'' if asked else 'out'} --lowercase or leave data.lowercase empty")
    return folds
  if asked is not None:
    return asked
  recorded = recorded_lowercase(directory)
  return True if recorded is None else recorded  # bert-base-uncased's, when nothing says


def ensure_dataset(config: ml_collections.ConfigDict, workdir: paths.PathLike,
                   build: bool = True) -> str:
  """The built dataset a `data.source="corpus"` run reads (`readable`): `data.dataset`, or
  WORKDIR/data/dataset, built on first use (locally, then uploaded when the workdir is
  remote) unless `build` is False (processes other than the one that builds)."""
  if config.data.dataset:
    return readable(config.data.dataset)
  target = paths.path(workdir) / "data"
  dataset_dir = target / "dataset"
  if (dataset_dir / "dataset.json").is_file() and (dataset_dir / "parts").is_dir() and any(
      (dataset_dir / "parts").iterdir()):
    return readable(dataset_dir)
  if not build:
    raise ValueError(f"{dataset_dir} was not built (data.dataset is empty and the process that "
                     "builds on first use did not write it: is the workdir shared by all hosts?)")
  # The tokenizer trainer and ArrayRecord write local files only.
  with paths.local_output(target) as local:
    sources = parse_sources(config.data.sources)
    tokenizer = config.data.tokenizer
    lowercase = build_lowercase(config.data.get("lowercase", ""), tokenizer)
    if not tokenizer:
      style = families.get(config.model.family).tokenizer_style
      log.info("training a %s-style SentencePiece tokenizer (%d pieces) on %s", style,
               config.model.vocab_size, config.data.sources)
      coverage = float(config.data.get("character_coverage", 0.9995))
      tokenizer = str(train_sentencepiece(corpus_sentences(sources), local / "tokenizer",
                                          vocab_size=int(config.model.vocab_size)
                                          - appended_pieces(style),
                                          model_type="unigram", style=style,
                                          lowercase=lowercase, character_coverage=coverage))
    log.info("building %s into %s", config.data.sources, dataset_dir)
    summary = build_dataset(sources, paths.local_copy(tokenizer), local / "dataset",
                            BuildOptions(num_shards=4, lowercase=lowercase,
                                         eval_fraction=float(config.data.eval_fraction),
                                         num_workers=int(config.data.build_workers)))
    for line in summary.lines():
      log.info("%s", line)
  return readable(dataset_dir)


def readable(dataset: paths.PathLike) -> str:
  """Where the loader reads the built dataset at `dataset` (checked now, not at the first
  batch): the path itself, local or on an object store (records are read as byte ranges,
  bertjax.data.shards); a remote dataset of format 2 or 3 (ArrayRecord, whose reader fetches
  far more than a record from an object store) is copied whole to this host's cache first."""
  opened = records.BuiltDataset.open(dataset)
  if paths.is_remote(dataset) and opened.format_version < 4:
    log.info("%s: format %d (ArrayRecord) is copied to this host before reading; rebuild it "
             "with this bertjax to stream it", dataset, opened.format_version)
    return str(paths.local_copy(dataset))
  return str(opened.root)
