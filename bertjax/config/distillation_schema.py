"""The `distillation` group of a run config (`distillation_group`): knowledge distillation of a
frozen teacher into the run's model (bertjax.training.distillation), each key with its default
and a comment saying what it does; guide: docs/training.md, 'Distillation'.
`bertjax.config.schema.base_config` puts it in every config; off while `teacher` is empty.
"""

from __future__ import annotations

import ml_collections

ConfigDict = ml_collections.ConfigDict


def distillation_group() -> ConfigDict:
  """The `distillation` group: knowledge distillation (Hinton et al. 2015) of a frozen teacher
  into the run's model, the student (DistilBERT, Sanh et al. 2019; distilgpt2), in the same
  train step (bertjax.training.distillation). Off while `teacher` is empty; the defaults are
  DistilBERT's (huggingface/transformers examples/research_projects/distillation)."""
  return ConfigDict({
      # The teacher's weights: a params-only checkpoint (model.json), a training workdir (its
      # latest or `teacher_step`'s checkpoint) or a Hugging Face directory (config.json +
      # safetensors); local or an object store. Its vocabulary must be the student's (and the
      # data's: build it with the teacher's tokenizer). Empty: no distillation.
      "teacher": "",
      # With a training workdir as teacher: its checkpoint step (-1: the latest).
      "teacher_step": -1,
      # Softmax temperature T of both distributions in the soft loss (DistilBERT: 2).
      "temperature": 2.0,
      # Weight of the soft loss: T^2 x KL(softmax(teacher/T) || softmax(student/T)), the mean
      # over the positions it covers (DistilBERT: 5).
      "alpha_ce": 5.0,
      # Weight of the student's own masked-LM loss, a BERT student's hard loss (DistilBERT: 2).
      "alpha_mlm": 2.0,
      # Weight of the student's own causal-LM loss, a GPT student's hard loss (DistilBERT: 0;
      # set it, and alpha_mlm to 0, for a GPT student).
      "alpha_clm": 0.0,
      # Weight of the cosine-embedding loss 1 - cos(student, teacher) between the last hidden
      # states at every real token, the mean over them (DistilBERT: 1; needs the same width).
      "alpha_cos": 1.0,
      # BERT: the soft loss at the masked positions only (the reference's
      # --restrict_ce_to_mask); False: at every real token, as DistilBERT was trained.
      "restrict_ce_to_mask": False,
      # Start the student from the teacher: its layers from the teacher's `teacher_layers`,
      # every other parameter the two share in shape (embeddings, their norm, the LM head)
      # copied. False: a random init (or init_from).
      "init_from_teacher": False,
      # Which teacher layer each student layer starts from: "every_other" (0, 2, 4, ...) or a
      # comma-separated list, one per student layer (DistilBERT's script: 0,2,4,7,9,11).
      "teacher_layers": "every_other",
      # Give the student's position table no update (DistilBERT: frozen at BERT's values; the
      # reference's --freeze_pos_embs).
      "freeze_position_embeddings": False,
  })
