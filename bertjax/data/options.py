"""The data settings, with their defaults: what a build (`BuildOptions`) and the loader
(`LoaderConfig`) take. The run config's `data` group (bertjax.config.schema) and `bertjax data
build` take their defaults from here, so there is one set of them.
"""

from __future__ import annotations

import dataclasses

from bertjax.data import span_masking


@dataclasses.dataclass(frozen=True)
class BuildOptions:
  num_shards: int = 8
  # Worker processes for cleaning/splitting/tokenizing (0: in the main process).
  num_workers: int = 0
  # Fraction of documents held out for evaluation, chosen by a hash of the document key.
  eval_fraction: float = 0.05
  process_index: int = 0
  process_count: int = 1
  # Stop after this many documents per source (0: all); for quick looks and benchmarks.
  max_documents: int = 0
  # Sentence-splitting language of sources that do not state their own (`?language=`).
  language: str = "en"
  # A vocab.txt tokenizer only: lower-case (bert-*-uncased) or not (-cased).
  lowercase: bool = True
  # Drop exact duplicate documents within each source (the first is kept), counted.
  dedup: bool = True
  # Evaluation sets (files or directories: SQuAD/GLUE/JSONL/plain text): documents sharing a
  # word n-gram with one of them are dropped and counted (bertjax.data.decontamination).
  decontaminate: tuple[str, ...] = ()
  # ... the n of those n-grams (GPT-3: 13).
  decontamination_ngram: int = 13


# data.row_balance: rows dealt documents in turn, or balanced by what they read.
ROW_BALANCE_MODES = ("documents", "tokens")
# data.corrupt_records: a record failing its checksum is skipped and counted, or stops the run.
CORRUPT_RECORD_MODES = ("skip", "error")


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
  """What the loader needs from the run config (`data.*`, `seq_length`, `objective`)."""

  dataset: str
  # mlm_nsp | mlm | mlm_sop | mlm_sbo | rtd | causal_lm | span_corruption | denoising
  objective: str
  seq_length: int
  max_predictions: int = 20
  mask_prob: float = 0.15
  # Of the masked positions, the fraction given [MASK]; of the others, the fraction given a
  # random token (the rest keep theirs): BERT's 80/10/10.
  mask_token_prob: float = 0.8
  random_token_prob: float = 0.5
  # Which positions are masked: "token" (google-research/bert: single pieces, or whole words
  # with whole_word_mask), "ngram" (ALBERT: n-grams of whole words, p(n) ∝ 1/n up to
  # ngram_max) or "span" (SpanBERT: spans of whole words, Geometric(span_geometric_p) lengths
  # clipped at span_max_length, 80/10/10 decided per span); bertjax.data.span_masking.
  masking: str = "token"
  # n-gram masking: the longest n-gram, in words (ALBERT: 3).
  ngram_max: int = 3
  # Span masking: p of the geometric distribution of span lengths (SpanBERT: 0.2, mean 3.8
  # words after clipping) ...
  span_geometric_p: float = 0.2
  # ... and the longest span in words (SpanBERT: 10); also the most tokens of a span given a
  # span-boundary target (objective mlm_sbo: the SBO head's relative-position rows).
  span_max_length: int = 10
  # The encoder-decoders' noise (bertjax.data.denoising; its fraction is mask_prob: T5's noise
  # density 0.15, BART's mask ratio 0.3): T5's mean noise span length, BART's Poisson mean of
  # span lengths (both 3).
  noise_span_length: float = 3.0
  # BERT: "pairs" (google-research/bert instances: A/B segments, NSP labels) or
  # "full_sentences" (RoBERTa FULL-SENTENCES: no pairs, packed across documents) or
  # "doc_sentences" (RoBERTa DOC-SENTENCES, SpanBERT's single segments: the same within one
  # document) or "packed" (ModernBERT: [CLS] doc [SEP] streams cut into full rows, with
  # document ids and positions per row).
  bert_instances: str = "pairs"
  short_seq_prob: float = 0.1
  # Pairs: epochs e and e + dupe_factor see the same instances (google-research/bert's static
  # copies); 0: new instances and masks every epoch (dynamic masking).
  dupe_factor: int = 10
  whole_word_mask: bool = False
  seed: int = 0
  num_epochs: int = 0  # 0: repeat forever
  # BERT pairs: each row stream shuffles its instances in windows of this many (a document's
  # instances apart, several documents interleaved); 0 or 1: in document order.
  shuffle_window: int = 64
  num_workers: int = 0
  prefetch: int = 2
  # "name=weight,..." overrides the mixing weights the dataset was built with (0: left out).
  weights: str = ""
  # Documents per training epoch, apportioned among the sources by weight; 0: as many as the
  # mixed sources hold (with weights = sizes, every document once).
  epoch_documents: int = 0
  # Which documents each training batch row reads: "documents" (row r: documents r, r+B, ...
  # of the global order: equal counts) or "tokens" (each epoch's documents dealt to the rows
  # by token count, bertjax.data.balance: a finite run ends with nearly every token read).
  row_balance: str = "documents"
  # A record that fails its check (its CRC-32; bertjax.data.shards): "skip" leaves it out of
  # every row, deterministically, and logs its shard file and index; "error" stops with one
  # line naming them.
  corrupt_records: str = "skip"
  # The run evaluates (eval_every > 0): a train loader checks the eval split is not empty, so
  # the run stops at start-up rather than at its first evaluation.
  require_eval: bool = False

  def __post_init__(self) -> None:
    if self.row_balance not in ROW_BALANCE_MODES:
      raise ValueError(f"data.row_balance={self.row_balance!r}; choose from {ROW_BALANCE_MODES}")
    if self.corrupt_records not in CORRUPT_RECORD_MODES:
      raise ValueError(f"data.corrupt_records={self.corrupt_records!r}; choose from "
                       f"{CORRUPT_RECORD_MODES}")
    span_masking.check_settings(self.masking, self.ngram_max, self.span_geometric_p,
                                self.span_max_length)
