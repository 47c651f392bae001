"""The `data` group of a run config (`data_group`): the corpus, its build on first use, the
instances and the loader, each key with its default and a comment saying what it does; guide:
docs/data.md. `bertjax.config.schema.base_config` puts it in every config; its defaults are the
data package's own (bertjax.data.options), so there is one set of them.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from bertjax.data.options import BuildOptions, LoaderConfig

ConfigDict = ml_collections.ConfigDict


_LOADER = {f.name: f.default for f in dataclasses.fields(LoaderConfig)}


def data_group() -> ConfigDict:
  """The `data` group: the corpus, its build on first use, instances and the loader. The
  defaults are the data package's own (BuildOptions, LoaderConfig): one set everywhere."""
  return ConfigDict({
      # corpus: a built dataset (bertjax.data.pipeline); synthetic_markov: a learnable
      # synthetic stream (tests only).
      "source": "corpus",
      # Built dataset directory (`bertjax data build`); empty: build `sources` into
      # WORKDIR/data on first use (single process).
      "dataset": "",
      # What to build when `dataset` is empty: comma-separated kind:path[@weight] specs
      # (bertjax.data.sources); "embedded" is the packaged Wikipedia sample.
      "sources": "embedded",
      # Tokenizer for that build (vocab.txt or SentencePiece dir); empty: train SentencePiece.
      "tokenizer": "",
      # Character coverage of that trained SentencePiece: the rarest characters beyond it are
      # unknown (bert style) or bytes (gpt style); raise it to 1.0 for a script with many rare
      # characters, if the vocabulary can hold them all.
      "character_coverage": 0.9995,
      # Casing of that build: "true" lower-cases (a trained SentencePiece folds case with
      # nmt_nfkc_cf / nfkc_cf; a vocab.txt is read lower-cased with accents stripped), "false"
      # keeps case (needed for a cased vocab.txt); "": each tokenizer's default, a trained
      # SentencePiece cased and a vocab.txt as recorded next to it, else lower-cased. A given
      # SentencePiece model keeps the casing it was trained with (contradicting it: an error).
      "lowercase": "",
      # Documents held out for evaluation in that build (by a hash of the document key).
      "eval_fraction": BuildOptions.eval_fraction,
      # Worker processes of that build (0: in the training process).
      "build_workers": 0,
      # Fraction of tokens masked for MLM; of tokens in noise spans for the encoder-decoders
      # (T5's noise density 0.15, BART's mask ratio 0.3).
      "mask_prob": _LOADER["mask_prob"],
      # The encoder-decoders' span lengths: T5's mean noise span length, BART's Poisson mean
      # (both 3).
      "noise_span_length": _LOADER["noise_span_length"],
      # Of the masked positions, the fraction given [MASK] (BERT 0.8, ELECTRA 0.85, DeBERTa-v3
      # 1.0) ...
      "mask_token_prob": _LOADER["mask_token_prob"],
      # ... and of the others the fraction given a random token, the rest keeping theirs
      # (BERT 0.5: 10% of all; ELECTRA, DeBERTa-v3 0).
      "random_token_prob": _LOADER["random_token_prob"],
      # Which positions are masked: "token" (google-research/bert; whole_word_mask groups a
      # word's pieces), "ngram" (ALBERT: whole-word n-grams, p(n) ∝ 1/n up to ngram_max) or
      # "span" (SpanBERT: whole-word spans, Geometric(span_geometric_p) lengths clipped at
      # span_max_length words, 80/10/10 per span); bertjax.data.span_masking.
      "masking": _LOADER["masking"],
      # n-gram masking: the longest n-gram, in words (ALBERT: 3).
      "ngram_max": _LOADER["ngram_max"],
      # Span masking: p of the geometric span-length distribution (SpanBERT: 0.2) ...
      "span_geometric_p": _LOADER["span_geometric_p"],
      # ... and the longest span in words (SpanBERT: 10); also the deepest offset in a span
      # given a span-boundary target (objective mlm_sbo).
      "span_max_length": _LOADER["span_max_length"],
      # BERT instances: "pairs" (google-research/bert A/B segments + NSP labels),
      # "full_sentences" (RoBERTa FULL-SENTENCES packing, no pairs), "doc_sentences" (RoBERTa
      # DOC-SENTENCES: full_sentences within one document; SpanBERT) or "packed" (ModernBERT:
      # [CLS] doc [SEP] streams cut into full rows, no padding, with document_ids/positions
      # per row so attention stays within a document; use with objective "mlm").
      "bert_instances": _LOADER["bert_instances"],
      # Pairs: probability of a shorter target length (google-research/bert short_seq_prob).
      "short_seq_prob": _LOADER["short_seq_prob"],
      # Pairs: epochs e and e + dupe_factor repeat instances and masks (the reference's static
      # copies); 0: new instances and masks every epoch (dynamic masking).
      "dupe_factor": _LOADER["dupe_factor"],
      # Mask whole words (all "##" pieces of a word together).
      "whole_word_mask": _LOADER["whole_word_mask"],
      # Seed of the data order and masking (fine-tuning: of the order of the task's rows).
      "seed": _LOADER["seed"],
      # Epochs over the training documents (0: repeat until num_train_steps).
      "num_epochs": _LOADER["num_epochs"],
      # BERT pairs: every batch row has its own stream of instances (bertjax.data.pipeline);
      # each shuffles its instances in windows of this many, so a document's pairs spread
      # over steps and several documents interleave (0: document order).
      "shuffle_window": _LOADER["shuffle_window"],
      # Loader worker processes (0: the training process) and batches prefetched per worker.
      "num_workers": _LOADER["num_workers"],
      "prefetch": _LOADER["prefetch"],
      # Mixing weights "name=weight,..." (0 leaves a source out), overriding the build's
      # `kind:path@weight`s; none stated anywhere: each source weighs its size, so an epoch is
      # every document once. Stating some sources' weights but not others' is an error.
      "weights": _LOADER["weights"],
      # Documents per training epoch, shared among the sources by weight (an up-weighted source
      # repeats, a down-weighted one is sub-sampled); 0: as many as the mixed sources hold.
      "epoch_documents": _LOADER["epoch_documents"],
      # Which documents each batch row reads: "documents" (row r of B: documents r, r+B, ...
      # of the epoch's order) or "tokens" (dealt by token count, so the rows run out
      # together: a finite num_epochs ends with nearly every token read; docs/data.md).
      "row_balance": _LOADER["row_balance"],
      # A record of the built dataset that fails its CRC-32 (or whose header is damaged):
      # "skip" leaves it out of every batch row, the same on any number of hosts and after a
      # resume, logging its shard file and record index and counting it; "error" stops the
      # run with one line naming them (exit status 2). Datasets built before checksums
      # (format 4) are read unchecked.
      "corrupt_records": _LOADER["corrupt_records"],
  })
