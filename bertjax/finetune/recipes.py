"""Named fine-tuning presets (`bertjax finetune --recipe NAME`): how pre-trained weights are used,
task by task, as fine-tuning settings by their friendly names (bertjax.config.finetune.SETTINGS:
the `bertjax finetune` flags). Flags given with a recipe override its values.

Sources: Devlin et al. 2019 (GLUE, SQuAD); the course table this project serves (SQuAD lr 3e-5
for 2 epochs; GPT generation lr 1e-5..3e-5 for 2-5 epochs; domain NER with the bottom layers
frozen); Hu et al. 2021 (LoRA); Houlsby et al. 2019 (adapters); Li & Liang 2021 (prefix
tuning); Raffel et al. 2020 (T5); Lewis et al. 2020 and fairseq's BART recipes.

The guide: docs/finetuning.md, 'Recipes'.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Recipe:
  # What the recipe is for, one line (the docs' table and --help).
  purpose: str
  # Settings by their friendly names (the flags').
  values: dict[str, Any]


RECIPES: dict[str, Recipe] = {
    "glue": Recipe(
        "sentence / sentence-pair classification (GLUE, sentiment, entailment): full "
        "fine-tuning, Devlin et al.'s recipe",
        dict(task="classification", learning_rate=2e-5, batch_size=32, epochs=3.0,
             warmup_fraction=0.1, seq_length=128)),
    "sts": Recipe(
        "sentence-pair similarity scores (STS-B): regression on the pooled output",
        dict(task="regression", learning_rate=2e-5, batch_size=32, epochs=3.0,
             metric="pearson", seq_length=128)),
    "ner": Recipe(
        "named-entity recognition / tagging (CoNLL-2003): a classifier on every token",
        dict(task="token_classification", learning_rate=5e-5, batch_size=32, epochs=3.0,
             seq_length=128)),
    "ner-domain": Recipe(
        "tagging in a new domain with little data: the bottom 8 layers (and embeddings) "
        "frozen, the top layers and the head trained",
        dict(task="token_classification", learning_rate=5e-5, batch_size=32, epochs=3.0,
             freeze="bottom:8", seq_length=128)),
    "feature-extraction": Recipe(
        "a frozen encoder as a feature extractor: only the head trains, at its own rate",
        dict(task="classification", freeze="all_but_head", learning_rate=2e-5,
             head_learning_rate=1e-3, epochs=3.0)),
    "squad": Recipe(
        "extractive question answering (SQuAD v1.1 / v2.0): full fine-tuning, 384-token "
        "windows 128 apart, 64-token questions",
        dict(task="question_answering", learning_rate=3e-5, batch_size=32, epochs=2.0,
             seq_length=384, doc_stride=128, max_query_length=64, max_answer_length=30)),
    "completion": Recipe(
        "GPT on prompt/completion pairs (instructions, summaries): loss on the completions",
        dict(task="completion", learning_rate=2e-5, batch_size=8, epochs=3.0,
             warmup_fraction=0.03, weight_decay=0.0, seq_length=1024)),
    "dialogue": Recipe(
        "GPT on chat transcripts (`messages` JSONL): loss on the assistant turns",
        dict(task="completion", learning_rate=1e-5, batch_size=8, epochs=3.0,
             warmup_fraction=0.03, weight_decay=0.0, seq_length=1024)),
    "t5": Recipe(
        "T5 text to text (SQuAD as \"question: … context: …\", label words, prompt/"
        "completion): Raffel et al.'s fine-tuning, Adafactor at a constant 1e-3, batch 128",
        dict(task="text_to_text", optimizer="adafactor", schedule="constant",
             learning_rate=1e-3, batch_size=128, epochs=3.0, warmup_fraction=0.0,
             weight_decay=0.0, seq_length=512, target_length=64)),
    "bart": Recipe(
        "BART text to text (the same formats): AdamW at 3e-5, 6% warmup then linear decay, "
        "as fairseq's BART fine-tuning",
        dict(task="text_to_text", learning_rate=3e-5, batch_size=32, epochs=3.0,
             warmup_fraction=0.06, weight_decay=0.01, seq_length=512, target_length=64)),
    "lora": Recipe(
        "parameter-efficient tuning with LoRA (rank 16, alpha 32; BERT query,value or "
        "GPT qkv): only the low-rank updates and the head train and are saved",
        dict(freeze="base", lora_rank=16, lora_alpha=32.0, lora_dropout=0.05,
             learning_rate=3e-4, weight_decay=0.0)),
    "adapters": Recipe(
        "bottleneck adapters (Houlsby et al., width 64) after every attention and MLP "
        "block: only the adapters and the head train",
        dict(freeze="base", adapter_size=64, learning_rate=1e-3, weight_decay=0.0)),
    "prefix": Recipe(
        "prefix tuning (Li & Liang, 20 key/value positions per layer): only the prefixes "
        "and the head train",
        dict(freeze="base", prefix_length=20, learning_rate=1e-3, weight_decay=0.0)),
}


def recipe_values(names: str) -> dict[str, Any]:
  """The settings of `names` ("squad", or several joined by "+", e.g.
  "completion+lora": later recipes override earlier ones)."""
  values: dict[str, Any] = {}
  for name in names.split("+"):
    if name not in RECIPES:
      raise ValueError(f"unknown recipe {name!r}; recipes: {', '.join(RECIPES)}")
    values.update(RECIPES[name].values)
  return values
