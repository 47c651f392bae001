"""`bertjax data build --runner …`: the dataset build as an Apache Beam pipeline, for builds
beyond one machine (Dataflow, Flink, Spark) or on a machine's cores (the DirectRunner).

The output is byte-identical to the local build (bertjax.data.build): the same readers,
cleaning, sentence splitting, tokenisation, held-out split and shard assignment. A streamed
source is read by one worker, a multistream dump in parallel by byte ranges (tasks of
`_TASK_BYTES`); each shard is written by one worker, the whole file at once, so a retried
bundle writes the same bytes again.

The guide: docs/data.md, 'Building on Apache Beam'.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from bertjax import paths
from bertjax.data import build, multistream, records
from bertjax.data.errors import CorpusError, SkipCounts
from bertjax.data.options import BuildOptions
from bertjax.data.sources import SourceSpec, read_source
from bertjax.data.tokenizers import load_tokenizer

RUNNERS = ("DirectRunner", "BundleBasedDirectRunner", "DataflowRunner", "FlinkRunner",
           "SparkRunner", "PrismRunner")


def _beam():
  try:
    import apache_beam  # noqa: PLC0415 - optional (the beam extra)
  except ImportError:
    raise CorpusError("--runner needs Apache Beam: pip install 'bertjax[beam]'") from None
  return apache_beam


def _read_stream(item: tuple[int, SourceSpec], options: BuildOptions) -> Iterator[tuple]:
  """One source read in order: ('chunk', source, [(split, key, shard, ordinal, document)]) of
  up to `build._CHUNK_DOCUMENTS`, then ('read', source, the reader's skips)."""
  number, spec = item
  skips = SkipCounts()
  documents = read_source(spec, skips, raw_pages=True)
  if options.dedup:
    documents = build._unique(documents, skips)
  # process_count is 1 here: the chunks hold every shard's documents.
  for chunk in build._owned_chunks(documents, spec.name, options,
                                   {split: 0 for split in records.SPLITS}):
    yield "chunk", number, chunk
  yield "read", number, dict(skips.counts)


class _Worker:
  """The build's worker state (tokenizer, language of each source) in a Beam worker."""

  def __init__(self, tokenizer_dir: str, lowercase: bool, sources: list[SourceSpec],
               options: BuildOptions):
    self.tokenizer_dir, self.lowercase = tokenizer_dir, lowercase
    self.sources, self.options = sources, options

  def setup(self) -> None:
    build._init_worker(str(paths.local_copy(self.tokenizer_dir)), self.lowercase)

  def language(self, number: int) -> str:
    return self.sources[number].language or self.options.language


def _tokenized_chunk(worker: _Worker, element: tuple) -> Iterator[tuple]:
  """(source, split, shard) -> (order, record, sentences, tokens) per document of a chunk, and
  ('skips', source) -> its skips."""
  _, number, chunk = element
  spec = worker.sources[number]
  results, skips = build._tokenize_chunk([(key, doc) for _, key, _, _, doc in chunk],
                                         worker.language(number), spec.keep_lists)
  for (split, _, shard, ordinal, _), (_, record, sentences, tokens) in zip(chunk, results):
    yield (number, split, shard), ((ordinal,), record, None, sentences, tokens)
  yield ("skips", number), dict(skips)


def _tokenized_streams(worker: _Worker, task: tuple) -> Iterator[tuple]:
  """A multistream task: its pages by (source, split, shard), in dump order, with digests."""
  number, shard, task_index, dump, lo, hi, index = task
  spec = worker.sources[number]
  result = build._build_streams(dump, lo, hi, index, spec.name, worker.options.eval_fraction,
                                worker.language(number), spec.keep_lists)
  for row, (split, record, digest, sentences, tokens) in enumerate(result["rows"]):
    yield (number, split, shard), ((task_index, row), record, digest, sentences, tokens)
  yield ("skips", number), dict(result["skips"])


def _write_shard(out: str, sources: list[SourceSpec], num_shards: int, dedup: bool,
                 item: tuple) -> Iterator[tuple]:
  """Writes one shard from its documents, in order; yields ('counts', source, split) and
  ('skips', source) for the summary."""
  (number, split, shard), rows = item
  name = sources[number].name
  counts = {"documents": 0, "sentences": 0, "tokens": 0}
  skips: collections.Counter = collections.Counter()
  seen: set[int] = set()
  with paths.local_output(paths.path(out) / name) as local:
    local.mkdir(parents=True, exist_ok=True)
    writer = records.ShardWriter(local / records.shard_name(split, shard, num_shards))
    try:
      for _, record, digest, sentences, tokens in sorted(
          (r for r in rows if r is not None), key=lambda r: r[0]):
        if digest is not None and dedup:  # a multistream shard drops repeats within itself
          if digest in seen:
            skips["duplicate document"] += 1
            continue
          seen.add(digest)
        if record is not None:
          writer.write(record, tokens)
          build._count(counts, sentences, tokens)
    finally:
      writer.close()
  yield ("counts", number, split), counts
  if skips:
    yield ("skips", number), dict(skips)


def _write_part(out: str, sources: list[SourceSpec], start: float,
                totals: Iterable[tuple]) -> None:
  """parts/process-0.json, as the local build's single process writes it: counts and skips."""
  counts = {s.name: {split: {"documents": 0, "sentences": 0, "tokens": 0}
                     for split in records.SPLITS} for s in sources}
  skips: dict = {s.name: collections.Counter() for s in sources}
  for key, value in totals:
    name = sources[key[1]].name
    if key[0] == "counts":
      for k, v in value.items():
        counts[name][key[2]][k] += v
    else:
      skips[name].update(value)
  part = {"process_index": 0, "counts": counts,
          "skips": {name: dict(+c) for name, c in skips.items()},
          "seconds": time.perf_counter() - start}
  (paths.path(out) / "parts").mkdir(parents=True, exist_ok=True)
  (paths.path(out) / "parts" / "process-0.json").write_text(json.dumps(part, indent=2) + "\n")


def build_with_beam(sources: list[SourceSpec], tokenizer_path: str | Path, out_dir: str | Path,
                    options: BuildOptions, pipeline_args: list[str]) -> build.BuildSummary:
  """Builds `sources` into `out_dir` (local or an object store every worker can write) with a
  Beam pipeline; `pipeline_args`: Beam's own options (--runner, --project, --region, …)."""
  beam = _beam()
  from apache_beam.options.pipeline_options import PipelineOptions  # noqa: PLC0415 - optional
  start = time.perf_counter()
  names = [s.name for s in sources]
  if len(set(names)) != len(names):
    raise ValueError(f"source names must be distinct, got {names}; name them with ?name=")
  if options.decontaminate:
    raise ValueError("--decontaminate is not supported with --runner yet; build locally")
  if options.process_count != 1:
    raise ValueError("--process-index/--process-count are the local build's; a Beam runner "
                     "shares out the work itself")
  tokenizer_path = paths.local_copy(tokenizer_path)
  tokenizer = load_tokenizer(tokenizer_path, lowercase=options.lowercase)
  out = paths.path(out_dir)
  with paths.local_output(out) as local:  # dataset.json and the tokenizer, as the local build
    local.mkdir(parents=True, exist_ok=True)
    build._write_metadata(local, sources, tokenizer_path, tokenizer, options, None)
  worker = _Worker(str(out / "tokenizer"), options.lowercase, sources, options)
  streams, tasks = [], []
  for number, spec in enumerate(sources):
    dump = build._multistream_file(spec, options)
    if dump is None:
      streams.append((number, spec))
      continue
    size, index = paths.file_size(dump), multistream.find_index(dump)
    index_arg = None if index is None else str(index)
    # Numbered in dump order: a shard's rows are written in the order of its tasks.
    tasks += [(number, shard, t, str(dump), lo, hi, index_arg) for t, (shard, lo, hi) in
              enumerate(build.stream_tasks(size, options.num_shards, range(options.num_shards)))]
  every_shard = [((number, split, shard), None) for number in range(len(sources))
                 for split in records.SPLITS for shard in range(options.num_shards)]

  class Tokenize(beam.DoFn):
    def setup(self):
      worker.setup()

    def process(self, element):
      if element[0] == "chunk":
        yield from _tokenized_chunk(worker, element)
      elif element[0] == "read":
        yield ("skips", element[1]), element[2]
      else:
        yield from _tokenized_streams(worker, element[1])

  options_beam = PipelineOptions(pipeline_args)
  with beam.Pipeline(options=options_beam) as pipeline:
    read = (pipeline | "Streams" >> beam.Create(streams)
            | "Read" >> beam.FlatMap(lambda item: _read_stream(item, options)))
    pages = pipeline | "Tasks" >> beam.Create([("task", t) for t in tasks])
    tokenized = ((read, pages) | "Work" >> beam.Flatten() | beam.Reshuffle()
                 | "Tokenize" >> beam.ParDo(Tokenize()))
    documents = tokenized | beam.Filter(lambda kv: kv[0][0] != "skips")
    notes = tokenized | beam.Filter(lambda kv: kv[0][0] == "skips")
    written = ((documents, pipeline | "EveryShard" >> beam.Create(every_shard))
               | "Shards" >> beam.Flatten() | beam.GroupByKey()
               | "Write" >> beam.FlatMap(lambda item: _write_shard(
                   str(out), sources, options.num_shards, options.dedup, item)))
    ((written, notes) | "Totals" >> beam.Flatten() | beam.combiners.ToList()
     | "Part" >> beam.Map(lambda totals: _write_part(str(out), sources, start, totals)))
  part = json.loads((out / "parts" / "process-0.json").read_text())
  summary = build.BuildSummary(part["counts"], part["skips"], time.perf_counter() - start)
  for spec in sources:
    if not sum(c["documents"] for c in part["counts"][spec.name].values()):
      raise build._no_documents(spec, part["skips"][spec.name])
  return summary


def runner_args(runner: str, extra: list[str], num_workers: int) -> list[str]:
  """Beam's pipeline options for `--runner` (the DirectRunner in multi-processing mode with
  `--workers` processes unless the extra options say otherwise)."""
  args = [f"--runner={runner}", *extra]
  if runner == "DirectRunner" and not any(a.startswith("--direct_running_mode") for a in extra):
    args += ["--direct_running_mode=multi_processing",
             f"--direct_num_workers={max(1, num_workers)}"]
  return args


def known_runner(runner: str) -> str:
  if runner not in RUNNERS:
    raise ValueError(f"--runner {runner!r}: choose from {', '.join(RUNNERS)}")
  return runner

