"""Parameter counts for reports: by group (`bertjax info`), against the papers' figures, and
trainable against total for parameter-efficient tuning (LoRA, adapters, prefixes).

The counts come from the abstract parameters (`jax.eval_shape`): nothing is allocated, so a
billion-parameter config is counted on a laptop. tests/test_config_cli.py holds every paper
config to its paper's stated count.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np

from bertjax.models import Head, ModelConfig, abstract_params, build_model
from bertjax.models import peft as adapters
from bertjax.models.config import AUTO


def param_breakdown(config: ModelConfig, head: Head = "pretraining") -> dict[str, int]:
  """Parameter counts by group: embeddings, layers, heads, total, non_embedding; with a
  replaced-token-detection generator also `generator` (its own parameters, apart from the
  groups) and `discriminator` (the rest: the model fine-tuned, and what the papers count).

  `non_embedding` excludes the token and position tables (the N of 6·N·tokens FLOPs).
  """
  if config.dtype == AUTO:  # resolved when a run starts; the shapes do not depend on it
    config = config.replace(dtype="float32")
  params = nn.meta.unbox(abstract_params(build_model(config, head)))
  flat = {"/".join(str(getattr(k, "key", k)) for k in path): int(np.prod(leaf.shape))
          for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  # The encoder-decoders' token table is `shared` (T5, BART), BART's positions `positions`.
  embedding_tables = ("word_embeddings/", "position_embeddings/", "token_type_embeddings/",
                      "wte/", "wpe/", "shared/", "/positions/")
  groups = {"embeddings": 0, "layers": 0, "heads": 0}
  generator = sum(size for name, size in flat.items() if name.startswith("generator/"))
  for name, size in flat.items():
    if name.startswith("generator/"):
      continue
    if (any(t in f"/{name}" for t in embedding_tables) or "embeddings_norm" in name
        or "embedding_norm" in name):
      groups["embeddings"] += size
    elif "/encoder/" in f"/{name}" or "/decoder/" in f"/{name}" or "final_norm" in name:
      groups["layers"] += size
    else:
      groups["heads"] += size
  total = sum(flat.values())
  tables = sum(s for n, s in flat.items() if any(t in f"/{n}" for t in embedding_tables))
  counts = {**groups, "total": total, "non_embedding": total - tables}
  if generator:
    counts.update(generator=generator, discriminator=total - generator)
  return counts


def matches_reference(count: int, reference: int) -> bool:
  """Whether `count` rounds to a paper's stated count at the paper's own precision.

  Papers round: BERT-large's "340M" is 336.2M exactly (1.1% off), but 340M to the 10M its
  trailing zero implies. The precision is read off the reference's trailing zeros.
  """
  digits = str(int(reference))
  unit = 10 ** (len(digits) - len(digits.rstrip("0")))
  return abs(count - reference) <= unit / 2


def trainable_report(config: ModelConfig, freeze: str = "none",
                     head: Head = "pretraining") -> str | None:
  """Trainable against total parameters, with a per-addition breakdown (bertjax/models/peft.py),
  for `bertjax info`; None when nothing is frozen and nothing added.

  A model with additions under `freeze="none"` trains everything; the report then counts what
  `optimizer.freeze=base` (the parameter-efficient recipe) would train, and says so."""
  if not config.peft and freeze == "none":
    return None
  counted = "base" if config.peft and freeze == "none" else freeze
  counts = adapters.report(abstract_params(build_model(config, head)), config, counted)
  text = adapters.format_report(counts)
  if counted != freeze:
    text += (f"\n  (optimizer.freeze={freeze} trains all {counts['total']:,d}; set "
             "--config.optimizer.freeze=base to train only the additions and heads)")
  return text
