"""`bertjax data bench`: tokens per second per core of the data pipeline, on this machine.

Two numbers, as the pipeline's two halves run in production:
- raw text -> instances: read + clean + split sentences + tokenize + write shards (the build),
  then one epoch of instance creation from those shards; tokens are the corpus's tokens.
- built shards -> batches: the training loader alone (decode, shuffle, instances, batch),
  three epochs after its first batch (worker start-up is not throughput); tokens are the
  non-padding tokens of the batches.
Per core = tokens/s divided by the processes doing the work (1 + workers, at most the cores).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from bertjax.data import schema
from bertjax.data.build import build_dataset
from bertjax.data.options import BuildOptions, LoaderConfig
from bertjax.data.pipeline import CorpusBatches
from bertjax.data.prepare import corpus_sentences
from bertjax.data.sentencepiece_training import train_sentencepiece
from bertjax.data.sources import parse_sources


def _batch_tokens(batch: dict[str, np.ndarray]) -> int:
  if "attention_mask" in batch:
    return int(batch["attention_mask"].sum())
  return int(batch["input_ids"].size)


def loader_run(cfg: LoaderConfig, batch_size: int, num_batches: int
               ) -> tuple[int, float, float]:
  """(non-pad tokens, seconds, start-up seconds) of `num_batches` batches after the first;
  start-up is the first batch alone: worker processes start and every row stream fills its
  shuffle window."""
  start = time.perf_counter()
  batches = CorpusBatches(cfg, "train", range(batch_size), batch_size)
  tokens = 0
  try:
    next(batches)
    startup = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(num_batches):
      tokens += _batch_tokens(next(batches))
  finally:
    batches.close()
  return tokens, time.perf_counter() - start, startup


def run_bench(sources: str | list[str], *, tokenizer: str = "", objective: str = "mlm_nsp",
              seq_length: int = 128, batch_size: int = 32, workers: int = 0,
              out: str = "", epochs: int = 3) -> Iterator[str]:
  """Runs the benchmark, yielding report lines as results come in."""
  specs = parse_sources(sources or "embedded")
  spec = schema.objective(objective)
  cores = min(os.cpu_count() or 1, 1 + workers)
  with tempfile.TemporaryDirectory() as tmp:
    root = Path(out or tmp)
    if not tokenizer:
      start = time.perf_counter()
      style = "gpt" if spec.causal else "bert"
      tokenizer = str(train_sentencepiece(corpus_sentences(specs), root / "tokenizer",
                                          vocab_size=8192, model_type="unigram", style=style))
      yield (f"tokenizer: trained an 8192-piece {style} SentencePiece model in "
             f"{time.perf_counter() - start:.1f} s (not part of the numbers below)")
    summary = build_dataset(specs, tokenizer, root / "dataset",
                            BuildOptions(num_shards=4, num_workers=workers, eval_fraction=0.0))
    build_s = summary.seconds
    corpus_tokens = sum(c["train"]["tokens"] for c in summary.counts.values())
    documents = sum(c["train"]["documents"] for c in summary.counts.values())
    yield (f"build: {documents:,} documents, {corpus_tokens:,} tokens in {build_s:.2f} s = "
           f"{corpus_tokens / build_s / cores:,.0f} tokens/s/core ({1 + workers} processes, "
           f"{cores} cores)")
    # An endless stream, timed over `epochs` corpora's worth of sequences.
    cfg = LoaderConfig(dataset=str(root / "dataset"), objective=objective,
                       seq_length=seq_length, max_predictions=max(1, round(0.15 * seq_length)),
                       num_epochs=0, num_workers=workers, prefetch=4 if workers else 0,
                       # RoBERTa's recipe for MLM alone; google-research/bert's with NSP.
                       bert_instances="pairs" if spec.sentence_pairs else "full_sentences")
    num_batches = max(1, round(epochs * corpus_tokens / (batch_size * seq_length)))
    tokens, load_s, startup_s = loader_run(cfg, batch_size, num_batches)
    mode = ("GPT packed windows" if spec.causal else
            "BERT pairs, fidelity mode" if spec.sentence_pairs else "RoBERTa full sentences")
    yield (f"loader start-up (first batch: workers start, {batch_size} row streams fill their "
           f"windows): {startup_s:.2f} s")
    yield (f"instances ({mode}, seq {seq_length}): {num_batches} more batches of "
           f"{batch_size} ({epochs} corpora's worth of sequences), {tokens:,} non-pad tokens "
           f"in {load_s:.2f} s")
    yield (f"raw text -> instances: {corpus_tokens / (build_s + load_s / epochs) / cores:,.0f} "
           "tokens/s/core (corpus tokens over build + a corpus's worth of loading)")
    yield f"built shards -> batches: {tokens / load_s / cores:,.0f} tokens/s/core"
    yield (f"built shards -> batches, start-up included: "
           f"{tokens / (load_s + startup_s) / cores:,.0f} tokens/s/core")
