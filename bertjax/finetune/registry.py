"""The fine-tuning tasks' registry: every fact about a task that more than one module needs (the
kind of model it fine-tunes, its objective, head and default metric). A leaf: it imports nothing of
bertjax, so the config, checkpoint and training code can ask it without loading the task readers.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Task:
  """Every fact about a fine-tuning task that more than one module needs."""

  # The kind of model it fine-tunes (bertjax/models/families.py): "encoder" (a fresh head on
  # the encoder), "decoder" (the LM) or "encoder_decoder" (the LM head on the decoder).
  kind: str
  # The trainer's objective (bertjax.training.objectives).
  objective: str
  # The model's head (bertjax.models.build_model), also the Hugging Face export's head.
  head: str
  # The dev metric that selects the best parameters unless finetune.metric says otherwise.
  metric: str


TASKS: dict[str, Task] = {
    "classification": Task("encoder", "classification", "sequence_classification", "accuracy"),
    "regression": Task("encoder", "regression", "sequence_classification", "pearson"),
    "token_classification": Task("encoder", "token_classification", "token_classification", "f1"),
    "question_answering": Task("encoder", "question_answering", "question_answering", "f1"),
    "completion": Task("decoder", "causal_lm", "pretraining", "loss"),
    # Its selection metric is its data's (bertjax.finetune.text_to_text.FORMATS).
    "text_to_text": Task("encoder_decoder", "text_to_text", "pretraining", "f1"),
}
# Metrics where lower is better; every other selection metric is maximised.
LOWER_IS_BETTER = ("mse", "loss", "perplexity")


def task(name: str) -> Task:
  """The registry's entry, or a ValueError listing the tasks."""
  if name not in TASKS:
    raise ValueError(f"task must be one of {', '.join(TASKS)}, got {name!r}")
  return TASKS[name]
