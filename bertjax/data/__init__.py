"""Input data: corpora -> built datasets of tokenized documents -> local batches per host.

`make_batches` is what training calls: `data.source = "corpus"` reads a built dataset
(`data.dataset`, or the embedded Wikipedia sample built into the workdir on first use) through
the Grain loader; `"synthetic_markov"` is a learnable synthetic stream for tests. Both return an
iterator of this host's rows of each global batch with exact `get_state`/`set_state`, and a
row's data does not depend on which process loads it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence

import ml_collections
import numpy as np

from bertjax.data.denoising import t5_lengths
from bertjax.data.options import LoaderConfig
from bertjax.data.rows import NumberedBatches
from bertjax.data.schema import objective
from bertjax.data.synthetic import SyntheticMarkov

SOURCES = ("corpus", "synthetic_markov")


class SyntheticBatches(NumberedBatches):
  """`SyntheticMarkov` rows as a checkpointable iterator (its state is the batch number)."""

  def __init__(self, source: SyntheticMarkov, rows: Sequence[int], split: str):
    self._source, self._rows, self._split = source, rows, split

  def batch(self, number: int) -> dict[str, np.ndarray]:
    return self._source.batch(number, self._rows, self._split)


# LoaderConfig's fields that loader_config computes rather than copies from the `data` group:
# the run's shape and objective, the dataset it was given, whether the run evaluates.
_COMPUTED = ("dataset", "objective", "seq_length", "max_predictions", "require_eval")
# The `data` keys added after configs were written: LoaderConfig's defaults where one lacks them.
_DEFAULTED = ("masking", "ngram_max", "span_geometric_p", "span_max_length", "noise_span_length",
              "row_balance", "corrupt_records")
# Copied as the config holds them; every other `data` key is converted to its field's type.
_AS_GIVEN = ("bert_instances", "weights")
_FIELD_TYPES = {f.name: typing.get_type_hints(LoaderConfig)[f.name]
                for f in dataclasses.fields(LoaderConfig) if f.name not in _COMPUTED}


def loader_config(config: ml_collections.ConfigDict, dataset: str) -> LoaderConfig:
  """The loader's settings: the run config's `data` group, its shape and objective."""
  d = config.data
  values = {"dataset": dataset, "objective": config.objective,
            "seq_length": int(config.seq_length), "max_predictions": int(config.max_predictions)}
  for name, convert in _FIELD_TYPES.items():
    value = d.get(name, getattr(LoaderConfig, name)) if name in _DEFAULTED else getattr(d, name)
    values[name] = value if name in _AS_GIVEN else convert(value)
  # A run that evaluates needs eval documents: found out at start-up, not at the first eval.
  values["require_eval"] = int(config.eval_every) > 0
  return LoaderConfig(**values)


def decoder_length(config: ml_collections.ConfigDict) -> int:
  """The decoder's length in an encoder-decoder's batches (0 for the other objectives): T5's
  target length, fixed by the encoder's length and the noise (bertjax.data.denoising), BART's,
  the encoder's, or a text-to-text fine-tune's finetune.target_length."""
  spec = objective(config.objective)
  if spec.noise == "spans":
    d = config.data
    return t5_lengths(int(config.seq_length), float(d.mask_prob),
                      float(d.get("noise_span_length", LoaderConfig.noise_span_length)))[1]
  if spec.seq2seq and spec.finetuning:  # a text-to-text fine-tune's targets
    return int(config.finetune.target_length)
  return int(config.seq_length) if spec.seq2seq else 0


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
    from bertjax.data.pipeline import CorpusBatches  # noqa: PLC0415 - see above
    return CorpusBatches(loader_config(config, dataset), split, rows, int(config.batch_size))
  raise ValueError(f"unknown data.source {name!r}; sources: {', '.join(SOURCES)}")

