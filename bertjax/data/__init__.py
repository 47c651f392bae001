"""Input data: corpora -> built datasets of tokenized documents -> local batches per host.

`make_batches` is what training calls: `data.source = "corpus"` reads a built dataset
(`data.dataset`, or the embedded Wikipedia sample built into the workdir on first use) through
the Grain loader; `"synthetic_markov"` is a learnable synthetic stream for tests. Both return an
iterator of this host's rows of each global batch with exact `get_state`/`set_state`, and a
row's data does not depend on which process loads it.
"""

from __future__ import annotations

from typing import Sequence

import ml_collections
import numpy as np

from bertjax.data.options import LoaderConfig
from bertjax.data.rows import NumberedBatches
from bertjax.data.synthetic import SyntheticMarkov

SOURCES = ("corpus", "synthetic_markov")


class SyntheticBatches(NumberedBatches):
  """`SyntheticMarkov` rows as a checkpointable iterator (its state is the batch number)."""

  def __init__(self, source: SyntheticMarkov, rows: Sequence[int], split: str):
    self._source, self._rows, self._split = source, rows, split

  def batch(self, number: int) -> dict[str, np.ndarray]:
    return self._source.batch(number, self._rows, self._split)


def loader_config(config: ml_collections.ConfigDict, dataset: str) -> LoaderConfig:
  """The loader's settings: the run config's `data` group, its shape and objective."""
  d = config.data
  return LoaderConfig(
      dataset=dataset, objective=config.objective, seq_length=int(config.seq_length),
      max_predictions=int(config.max_predictions), mask_prob=float(d.mask_prob),
      mask_token_prob=float(d.mask_token_prob), random_token_prob=float(d.random_token_prob),
      bert_instances=d.bert_instances, short_seq_prob=float(d.short_seq_prob),
      dupe_factor=int(d.dupe_factor), whole_word_mask=bool(d.whole_word_mask),
      # The masking keys, with LoaderConfig's defaults for a config written before them.
      masking=str(d.get("masking", LoaderConfig.masking)),
      ngram_max=int(d.get("ngram_max", LoaderConfig.ngram_max)),
      span_geometric_p=float(d.get("span_geometric_p", LoaderConfig.span_geometric_p)),
      span_max_length=int(d.get("span_max_length", LoaderConfig.span_max_length)),
      noise_span_length=float(d.get("noise_span_length", LoaderConfig.noise_span_length)),
      seed=int(d.seed), num_epochs=int(d.num_epochs), shuffle_window=int(d.shuffle_window),
      num_workers=int(d.num_workers), prefetch=int(d.prefetch), weights=d.weights,
      epoch_documents=int(d.epoch_documents),
      row_balance=str(d.get("row_balance", LoaderConfig.row_balance)),
      # A run that evaluates needs eval documents: found out at start-up, not at the first eval.
      require_eval=int(config.eval_every) > 0)


def decoder_length(config: ml_collections.ConfigDict) -> int:
  """The decoder's length in an encoder-decoder's batches (0 for the other objectives): T5's
  target length, fixed by the encoder's length and the noise (bertjax.data.denoising), BART's,
  the encoder's, or a text-to-text fine-tune's finetune.target_length."""
  if config.objective == "span_corruption":
    from bertjax.data.denoising import t5_lengths
    d = config.data
    return t5_lengths(int(config.seq_length), float(d.mask_prob),
                      float(d.get("noise_span_length", LoaderConfig.noise_span_length)))[1]
  if config.objective == "text_to_text":  # a fine-tune's targets
    return int(config.finetune.target_length)
  return int(config.seq_length) if config.objective == "denoising" else 0


def make_batches(config: ml_collections.ConfigDict, split: str, rows: Sequence[int],
                 dataset: str = ""):
  """Rows `rows` (global row numbers, ascending) of every global batch of `split` ("train" or
  "eval"); a row's data is the same whichever process loads it.

  For `data.source="corpus"`, `dataset` is the built dataset directory (see
  `bertjax.data.prepare.ensure_dataset`)."""
  name = config.data.source
  if name == "synthetic_markov":
    source = SyntheticMarkov(vocab_size=config.model.vocab_size, seq_length=config.seq_length,
                             objective=config.objective, max_predictions=config.max_predictions,
                             mask_prob=config.data.mask_prob, seed=config.data.seed)
    return SyntheticBatches(source, rows, split)
  if name == "corpus":
    # Imported here: the loader brings Grain, which runs on synthetic data need not load.
    from bertjax.data.pipeline import CorpusBatches
    return CorpusBatches(loader_config(config, dataset), split, rows, int(config.batch_size))
  raise ValueError(f"unknown data.source {name!r}; sources: {', '.join(SOURCES)}")

