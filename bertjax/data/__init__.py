"""Input sources. Training reads `synthetic_markov` until the corpus pipeline is complete;
`wikipedia` streams MediaWiki dumps into clean articles (the pipeline's first stage)."""

from __future__ import annotations

import ml_collections

from bertjax.data.synthetic import SyntheticMarkov

SOURCES = ("synthetic_markov",)


def make_source(config: ml_collections.ConfigDict) -> SyntheticMarkov:
  """The batch source named by `config.data.source`."""
  name = config.data.source
  if name == "synthetic_markov":
    return SyntheticMarkov(vocab_size=config.model.vocab_size, seq_length=config.seq_length,
                           objective=config.objective, max_predictions=config.max_predictions,
                           mask_prob=config.data.mask_prob, seed=config.data.seed)
  raise ValueError(f"unknown data.source {name!r}; sources: {', '.join(SOURCES)}")
