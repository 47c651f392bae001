"""`bertjax data build` (`build_dataset`): raw corpora -> a built dataset of tokenized documents
(records.py).

The output is the same bytes whatever the parallelism: a document's split is a hash of its key,
its shard its ordinal within (source, split) modulo the shard count, and process P of N writes
the shards s % N == P. Worker processes clean, split and tokenize chunks while the main process
reads ahead and writes results back in order; a multistream dump is shared out by byte slices
instead (`stream_tasks`).

The guide: docs/data.md, 'Building'.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from bertjax import paths
from bertjax.data import multistream, records
from bertjax.data.decontamination import EvalSetStats, NgramIndex
from bertjax.data.errors import CorpusError, SkipCounts
from bertjax.data.options import BuildOptions
from bertjax.data.sentences import check_language, split_sentences
from bertjax.data.sources import SourceSpec, TextDocument, read_source
from bertjax.data.tokenizers import load_tokenizer
from bertjax.data.wikipedia import EMBEDDED_DUMP, Page, clean_page, read_stream_pages

log = logging.getLogger(__name__)

_CHUNK_DOCUMENTS = 64
_DEFAULT_OPTIONS = BuildOptions()  # frozen: one instance serves every call
# Compressed bytes of a multistream dump per worker task: a few dozen streams of ~100 pages,
# small enough that the tasks in flight stay a modest amount of memory.
_TASK_BYTES = 2 << 20


def eval_split(key: str, fraction: float) -> bool:
  digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "little") < fraction * 2**64


# Worker state: the tokenizer and the decontamination index, loaded once per worker process.
_worker_tokenizer = None
_worker_index: NgramIndex | None = None


def _init_worker(tokenizer_path: str, lowercase: bool, index_path: str = "",
                 ngram: int = 0) -> None:
  global _worker_tokenizer, _worker_index
  _worker_tokenizer = load_tokenizer(tokenizer_path, lowercase=lowercase)
  _worker_index = NgramIndex.load(index_path, ngram) if index_path else None


def _forget_index() -> None:
  """An in-process build leaves no index behind for the next."""
  global _worker_index
  _worker_index = None


def _tokenize_chunk(chunk: list[tuple[str, TextDocument]], language: str, keep_lists: bool
                    ) -> tuple[list[tuple[str, bytes | None, int, int]], collections.Counter]:
  """(key, record or None when skipped, sentences, tokens) per document, and the skips."""
  skips: collections.Counter = collections.Counter()
  texts: list[str] = []
  spans = []
  for i, (key, doc) in enumerate(chunk):
    if isinstance(doc, Page):  # MediaWiki pages are cleaned here, in the worker
      article = clean_page(doc, keep_lists=keep_lists)
      if article is None:
        skips["empty article"] += 1
        doc = TextDocument(id=doc.id, paragraphs=())
        chunk[i] = (key, doc)
      else:
        doc = TextDocument(id=doc.id, paragraphs=tuple(article.paragraphs))
    if _worker_index is not None and _worker_index.contains("\n".join(doc.paragraphs)):
      skips["contaminated document"] += 1
      doc = TextDocument(id=doc.id, paragraphs=())
      chunk[i] = (key, doc)
    start = len(texts)
    for paragraph in doc.paragraphs:
      if doc.sentences_given:
        if paragraph.strip():
          texts.append(paragraph)
      else:
        texts.extend(split_sentences(paragraph, language))
    if not getattr(_worker_tokenizer, "dummy_prefix", True):
      # Without a dummy prefix (gpt) a sentence after the first carries the space before it.
      texts[start + 1:] = [" " + text for text in texts[start + 1:]]
    spans.append((start, len(texts)))
  ids = _worker_tokenizer.encode_batch(texts) if texts else []
  out = []
  for (key, doc), (start, stop) in zip(chunk, spans):
    sentences = [s for s in ids[start:stop] if s]
    skips["empty sentence after tokenization"] += (stop - start) - len(sentences)
    if not sentences:
      if doc.paragraphs:  # an empty article is already counted as such
        skips["empty document"] += 1
      out.append((key, None, 0, 0))
      continue
    out.append((key, records.encode_record(key, sentences), len(sentences),
                sum(len(s) for s in sentences)))
  return out, +skips


def _build_streams(dump: str, lo: int, hi: int, index: str | None, name: str,
                   eval_fraction: float, language: str, keep_lists: bool) -> dict:
  """A worker task of a multistream build: the pages of the streams starting in the bytes
  [lo, hi) of `dump`, read, cleaned, split and tokenized here. Returns, in dump order, (split,
  record or None, content digest, sentences, tokens) per page, the skips, and the byte ranges
  read."""
  read_log: list[tuple[int, int]] = []
  reader_skips = SkipCounts()
  start, end = multistream.owned_range(dump, lo, hi, index, read_log)
  chunk = [(f"{name}:{page.id}", page)
           for page in read_stream_pages(dump, start, end, reader_skips, read_log)]
  # Digests of the pages as read: _tokenize_chunk empties the entries it drops.
  digests = [_content_digest(page) for _, page in chunk]
  results, skips = _tokenize_chunk(chunk, language, keep_lists)
  rows = [("eval" if eval_split(key, eval_fraction) else "train", record, digest, sentences,
           tokens)
          for (key, _), digest, (_, record, sentences, tokens) in zip(chunk, digests, results)]
  return {"rows": rows, "skips": skips + reader_skips.counts,
          "read": read_log}


def _multistream_file(spec: SourceSpec, options: BuildOptions) -> Path | None:
  """The dump a source names when it is read by bytes (one multistream file, local or on an
  object store: its byte ranges are ranged reads), else None."""
  if spec.kind != "wikipedia" or options.max_documents:
    return None
  if spec.path == "embedded":
    path = EMBEDDED_DUMP
  elif paths.is_remote(spec.path):
    path = paths.path(spec.path)
  else:
    path = Path(spec.path).expanduser()
  if not path.is_file() or not multistream.is_multistream(path):
    return None
  return path


@dataclasses.dataclass
class BuildSummary:
  counts: dict  # source -> split -> {documents, sentences, tokens}
  skips: dict  # source -> {reason: count}
  seconds: float
  # The n-gram size, the index and each evaluation set's counts (None: not decontaminated).
  decontamination: dict | None = None

  def lines(self) -> list[str]:
    out = []
    for name, splits in self.counts.items():
      for split, c in splits.items():
        out.append(f"{name}/{split}: {c['documents']:,} documents, {c['sentences']:,} "
                   f"sentences, {c['tokens']:,} tokens")
      skipped = self.skips.get(name, {})
      out.append(f"{name} skipped: " + (", ".join(f"{r}: {n:,}" for r, n in
                                                  sorted(skipped.items())) or "none"))
    if self.decontamination:
      d = self.decontamination
      out.extend("decontaminated against " + EvalSetStats(**e).line(d["ngram"])
                 for e in d["eval_sets"])
    out.append(f"{self.seconds:.1f} s")
    return out


def _content_digest(doc: TextDocument | Page) -> int:
  """A 64-bit digest of what the document says (a page's raw wikitext): equal digests are
  taken for exact duplicates (a chance collision among 10^8 documents is about 3 in 10^4)."""
  text = doc.wikitext if isinstance(doc, Page) else "\n".join(doc.paragraphs)
  return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"),
                                        digest_size=8).digest(), "little")


def _unique(documents: Iterable[TextDocument | Page],
            skips: SkipCounts) -> Iterator[TextDocument | Page]:
  """The documents without exact repeats of an earlier one (counted "duplicate document").
  Memory: one 64-bit digest per distinct document of the source."""
  seen: set[int] = set()
  for doc in documents:
    digest = _content_digest(doc)
    if digest in seen:
      skips.add("duplicate document")
      continue
    seen.add(digest)
    yield doc


def _owned_chunks(documents: Iterable[TextDocument | Page], name: str, options: BuildOptions,
                  ordinals: dict[str, int]
                  ) -> Iterator[list[tuple[str, str, int, int, TextDocument]]]:
  """Chunks of (split, key, shard, ordinal in the split, document) for the shards this process
  writes; `ordinals` counts the documents of each split read (by every process: all of them)."""
  chunk = []
  for n, doc in enumerate(documents):
    if options.max_documents and n >= options.max_documents:
      break
    key = f"{name}:{doc.id}"
    split = "eval" if eval_split(key, options.eval_fraction) else "train"
    ordinal = ordinals[split]
    shard = ordinal % options.num_shards
    ordinals[split] += 1
    # MediaWiki pages reach the workers uncleaned, so a process cleans only its own shards'
    # pages; with `dedup`, exact duplicates were dropped before the ordinals were counted.
    if shard % options.process_count != options.process_index:
      continue
    chunk.append((split, key, shard, ordinal, doc))
    if len(chunk) == _CHUNK_DOCUMENTS:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


def _in_order(pool, jobs: Iterable[tuple[object, Callable, tuple]],
              max_in_flight: int) -> Iterator[tuple[object, object]]:
  """(tag, fn(*args)) for each (tag, fn, args) of `jobs`, in input order, run in the worker
  pool (or here, without one) with at most `max_in_flight` jobs pending."""
  pending: collections.deque = collections.deque()
  for tag, fn, args in jobs:
    pending.append((tag, pool.submit(fn, *args) if pool else fn(*args)))
    if len(pending) >= max_in_flight:
      done, result = pending.popleft()
      yield done, result.result() if pool else result
  while pending:
    done, result = pending.popleft()
    yield done, result.result() if pool else result


def _count(counts: dict, num_sentences: int, num_tokens: int) -> None:
  """Adds one written document to a split's counts."""
  counts["documents"] += 1
  counts["sentences"] += num_sentences
  counts["tokens"] += num_tokens


def build_dataset(sources: list[SourceSpec], tokenizer_path: str | Path, out_dir: str | Path,
                  options: BuildOptions = _DEFAULT_OPTIONS) -> BuildSummary:
  """Builds (this process's shards of) a dataset from `sources` with the tokenizer at
  `tokenizer_path` (a vocab.txt or a SentencePiece directory) into `out_dir`, a local path or
  an object store (ArrayRecord writes local files: each process builds its shards locally and
  uploads them)."""
  tokenizer_path = paths.local_copy(tokenizer_path)
  if paths.is_remote(out_dir):
    with paths.local_output(out_dir) as local:
      return build_dataset(sources, tokenizer_path, local, options)
  start = time.perf_counter()
  out = Path(out_dir)
  names = [s.name for s in sources]
  if len(set(names)) != len(names):
    raise ValueError(f"source names must be distinct, got {names}; name them with ?name=")
  check_language(options.language)
  if not 0 <= options.process_index < options.process_count:
    raise ValueError(f"process_index {options.process_index} not in [0, "
                     f"{options.process_count})")
  tokenizer = load_tokenizer(tokenizer_path, lowercase=options.lowercase)
  index_dir, index_path, decontamination = None, "", None
  if options.decontaminate:
    n = options.decontamination_ngram
    if n < 1:
      raise ValueError(f"decontamination n-grams must have at least one word, got {n}")
    index, eval_sets = NgramIndex.from_eval_sets(options.decontaminate, n)
    index_dir = tempfile.mkdtemp(prefix="bertjax-decontamination-")
    index_path = str(Path(index_dir) / "ngrams.npy")
    index.save(index_path)
    decontamination = {"ngram": n, "distinct_ngrams": len(index), "index_digest": index.digest(),
                       "eval_sets": [dataclasses.asdict(e) for e in eval_sets]}
    for e in eval_sets:
      log.info("decontaminating against %s", e.line(n))
  out.mkdir(parents=True, exist_ok=True)
  (out / "parts").mkdir(exist_ok=True)
  if options.process_index == 0:
    _write_metadata(out, sources, tokenizer_path, tokenizer, options, decontamination)

  counts: dict = {}
  skips: dict = {}
  held_out: dict[str, dict[str, int]] = {}  # source -> documents read per split
  # Multistream source -> the bytes this process read; the other sources it reads whole.
  read: dict[str, dict] = {}
  # Spawned, never forked (JAX and threads in the parent); an executor rather than a Pool so a
  # worker that dies raises BrokenProcessPool instead of leaving its chunk pending forever.
  pool = (concurrent.futures.ProcessPoolExecutor(
      options.num_workers, mp_context=multiprocessing.get_context("spawn"),
      initializer=_init_worker,
      initargs=(str(tokenizer_path), options.lowercase, index_path,
                options.decontamination_ngram))
          if options.num_workers > 0 else None)
  if pool is None:
    _init_worker(str(tokenizer_path), options.lowercase, index_path,
                 options.decontamination_ngram)
  try:
    for spec in sources:
      dump = _multistream_file(spec, options)
      if dump is not None:
        counts[spec.name], skips[spec.name], read[spec.name] = _build_multistream(
            spec, dump, out, pool, options)
        continue
      reader_skips = SkipCounts()
      source_skips: collections.Counter = collections.Counter()
      (out / spec.name).mkdir(exist_ok=True)
      writers = {}
      for split in records.SPLITS:
        for shard in range(options.num_shards):
          if shard % options.process_count == options.process_index:
            path = out / spec.name / records.shard_name(split, shard, options.num_shards)
            writers[split, shard] = records.ShardWriter(path)
      source_counts = {split: {"documents": 0, "sentences": 0, "tokens": 0}
                       for split in records.SPLITS}
      ordinals = {split: 0 for split in records.SPLITS}
      held_out[spec.name] = ordinals
      documents = read_source(spec, reader_skips, raw_pages=True)
      if options.dedup:
        documents = _unique(documents, reader_skips)
      chunks = _owned_chunks(documents, spec.name, options, ordinals)
      language = spec.language or options.language
      jobs = ((chunk, _tokenize_chunk, ([(key, doc) for _, key, _, _, doc in chunk], language,
                                        spec.keep_lists)) for chunk in chunks)
      for chunk, (results, chunk_skips) in _in_order(pool, jobs,
                                                     2 * max(1, options.num_workers)):
        source_skips.update(chunk_skips)
        for (split, _, shard, _, _), (_, record, num_sentences, num_tokens) in zip(chunk,
                                                                                  results):
          if record is not None:
            writers[split, shard].write(record, num_tokens)
            _count(source_counts[split], num_sentences, num_tokens)
      for writer in writers.values():
        writer.close()
      if options.process_index == 0:  # every process reads the whole stream: count once
        source_skips.update(reader_skips.counts)
      counts[spec.name] = source_counts
      skips[spec.name] = dict(source_skips)
      # Every process reads the whole source, so each can tell none was read; that none was
      # left after cleaning and tokenization, only a single-process build knows.
      if not sum(ordinals.values()) or (
          options.process_count == 1 and not sum(c["documents"] for c in source_counts.values())):
        raise _no_documents(spec, source_skips if options.process_index == 0
                            else reader_skips.counts + source_skips)
    # When every process reads every source whole, each can tell the build held out nothing.
    if (options.eval_fraction > 0 and (not read or options.process_count == 1)
        and not sum(o["eval"] for o in held_out.values())
        and not sum(c["eval"]["documents"] for c in counts.values())):
      raise CorpusError(
          f"{out}: eval_fraction {options.eval_fraction} held out no document of "
          f"{sum(c['train']['documents'] for c in counts.values()):,} (the split is a hash of "
          "each document's key); use a larger --eval-fraction, or --eval-fraction 0 to hold "
          "out nothing")
  finally:
    if pool is not None:
      pool.shutdown(cancel_futures=True)
    _forget_index()
    if index_dir is not None:
      shutil.rmtree(index_dir, ignore_errors=True)
  summary = BuildSummary(counts, skips, time.perf_counter() - start, decontamination)
  part = {"process_index": options.process_index, "counts": counts, "skips": skips,
          "seconds": summary.seconds}
  if read:
    part["read"] = read
  (out / "parts" / f"process-{options.process_index}.json").write_text(
      json.dumps(part, indent=2) + "\n")
  return summary


def stream_tasks(size: int, num_shards: int,
                 shards: Iterable[int]) -> Iterator[tuple[int, int, int]]:
  """(shard, lo, hi) of a multistream dump of `size` bytes, in order: shard k's byte slice
  [k * size // num_shards, (k + 1) * size // num_shards) in tasks of `_TASK_BYTES`."""
  for shard in shards:
    lo, hi = shard * size // num_shards, (shard + 1) * size // num_shards
    for a in range(lo, hi, _TASK_BYTES):
      yield shard, a, min(a + _TASK_BYTES, hi)


def _build_multistream(spec: SourceSpec, dump: Path, out: Path, pool,
                       options: BuildOptions) -> tuple[dict, dict, dict]:
  """This process's shards of a multistream dump: (counts, skips, bytes read)."""
  size = paths.file_size(dump)
  index = multistream.find_index(dump)
  index_arg = None if index is None else str(index)
  (out / spec.name).mkdir(exist_ok=True)
  source_counts = {split: {"documents": 0, "sentences": 0, "tokens": 0}
                   for split in records.SPLITS}
  source_skips: collections.Counter = collections.Counter()
  read_log: list[tuple[int, int]] = []
  language = spec.language or options.language
  shards = [k for k in range(options.num_shards)
            if k % options.process_count == options.process_index]

  def jobs():
    for shard, lo, hi in stream_tasks(size, options.num_shards, shards):
      yield shard, _build_streams, (str(dump), lo, hi, index_arg, spec.name,
                                    options.eval_fraction, language, spec.keep_lists)

  writers: dict = {}
  seen: set[int] = set()
  current = None
  try:
    for shard, result in _in_order(pool, jobs(), 2 * max(1, options.num_workers)):
      if shard != current:  # duplicates are found within a shard
        for writer in writers.values():
          writer.close()
        writers = {split: records.ShardWriter(out / spec.name / records.shard_name(
            split, shard, options.num_shards)) for split in records.SPLITS}
        seen, current = set(), shard
      source_skips.update(result["skips"])
      read_log.extend(result["read"])
      for split, record, digest, num_sentences, num_tokens in result["rows"]:
        if options.dedup:
          if digest in seen:
            source_skips["duplicate document"] += 1
            continue
          seen.add(digest)
        if record is not None:
          writers[split].write(record, num_tokens)
          _count(source_counts[split], num_sentences, num_tokens)
  finally:
    for writer in writers.values():
      writer.close()
  # Shards none of whose byte slices holds a stream start are still written (empty).
  for shard in shards:
    for split in records.SPLITS:
      path = out / spec.name / records.shard_name(split, shard, options.num_shards)
      if not path.exists():
        records.ShardWriter(path).close()
  ranges = multistream.merge_ranges(read_log)
  read = {"bytes": sum(b - a for a, b in read_log), "file_bytes": size,
          "index": index is not None, "ranges": [list(r) for r in ranges]}
  # A process of a multi-process build reads only its share: it cannot tell none was read.
  if options.process_count == 1 and not sum(c["documents"] for c in source_counts.values()):
    raise _no_documents(spec, source_skips)
  return source_counts, dict(source_skips), read


def _no_documents(spec: SourceSpec, skipped: dict) -> CorpusError:
  """The error of a source that yielded no document, with what was skipped."""
  reasons = ", ".join(f"{r}: {n:,}" for r, n in sorted(skipped.items())) or "nothing skipped"
  return CorpusError(f"{spec.kind}:{spec.path}: no documents (skipped: {reasons})")


def _write_metadata(out: Path, sources: list[SourceSpec], tokenizer_path: str | Path,
                    tokenizer, options: BuildOptions, decontamination: dict | None) -> None:
  tokenizer_path = Path(tokenizer_path)
  target = out / "tokenizer"
  target.mkdir(exist_ok=True)
  if tokenizer_path.is_file():  # a vocab.txt
    shutil.copyfile(tokenizer_path, target / "vocab.txt")
  elif tokenizer_path.is_dir():
    for f in tokenizer_path.iterdir():
      if f.is_file():
        shutil.copyfile(f, target / f.name)
  else:
    raise CorpusError(f"{tokenizer_path}: no such tokenizer")
  if (target / "vocab.txt").is_file():
    # The casing this build tokenized with, whatever a copied record said.
    (target / "bertjax_tokenizer.json").write_text(json.dumps(
        {"type": "wordpiece", "lowercase": options.lowercase}) + "\n")
  meta = {
      "format_version": records.FORMAT_VERSION,
      "sources": [{"name": s.name, "kind": s.kind, "path": s.path, "weight": s.weight,
                   "language": s.language or options.language}
                  for s in sources],
      "num_shards": options.num_shards,
      "process_count": options.process_count,
      "eval_fraction": options.eval_fraction,
      "language": options.language,
      "dedup": options.dedup,
      "vocab_size": len(tokenizer),
  }
  if decontamination:
    meta["decontamination"] = decontamination
  (out / "dataset.json").write_text(json.dumps(meta, indent=2) + "\n")
