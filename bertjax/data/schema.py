"""The batch schema: the fields a batch of each objective carries, with their shapes and dtypes,
and the objective registry (`objective(name)`).

One vocabulary for pre-training and fine-tuning alike (Hugging Face's names where it has them).
The loaders produce these fields, the objectives read them, `bertjax compile` compiles against
`abstract_batch` and `bertjax bench` times `example_batch`; `check` refuses a batch whose fields
are not the schema's (the trainer calls it when it compiles the step).

The guide: docs/data.md, 'Batches: one schema'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Field:
  name: str
  # Dimensions by letter: B rows, L tokens, T decoder tokens, P masked-LM predictions.
  dims: str
  dtype: str
  # What the field holds (the docs and error messages say it).
  doc: str


INPUT_IDS = Field("input_ids", "BL", "int32", "token ids")
TOKEN_TYPE_IDS = Field("token_type_ids", "BL", "int32",
                       "segment of each token: 0 = sentence A, 1 = sentence B")
ATTENTION_MASK = Field("attention_mask", "BL", "int32", "1 = a token, 0 = padding")
DOCUMENT_IDS = Field("document_ids", "BL", "int32",
                     "packed rows: the document of each token, 1, 2, ... (0 = padding)")
POSITIONS = Field("positions", "BL", "int32", "packed rows: position within its document")
MASKED_LM_POSITIONS = Field("masked_lm_positions", "BP", "int32", "positions predicted")
MASKED_LM_IDS = Field("masked_lm_ids", "BP", "int32", "the original tokens there")
MASKED_LM_WEIGHTS = Field("masked_lm_weights", "BP", "float32",
                          "1 = a prediction, 0 = a padded slot")
NEXT_SENTENCE_LABELS = Field("next_sentence_labels", "B", "int32",
                             "NSP: 1 = B is a random sentence; SOP: 1 = A and B swapped")
SPAN_LEFT_POSITIONS = Field("span_left_positions", "BP", "int32",
                            "SBO: the token just before each predicted position's span")
SPAN_RIGHT_POSITIONS = Field("span_right_positions", "BP", "int32",
                             "SBO: the token just after each predicted position's span")
SPAN_OFFSETS = Field("span_offsets", "BP", "int32",
                     "SBO: the position's 1-based offset in its span (0 = no SBO target)")
TARGET_IDS = Field("target_ids", "BL", "int32", "the next token of each position")
LOSS_MASK = Field("loss_mask", "BL", "int32", "1 = a target that counts in the loss")
CLASS_LABELS = Field("labels", "B", "int32", "the class of each row")
SCORE_LABELS = Field("labels", "B", "float32", "the score of each row (regression)")
TAG_LABELS = Field("labels", "BL", "int32", "the tag of each token (-100: no loss)")
DECODER_INPUT_IDS = Field("decoder_input_ids", "BT", "int32",
                          "the decoder's tokens: the targets shifted right behind its start token")
DECODER_DOCUMENT_IDS = Field("decoder_document_ids", "BT", "int32",
                             "the decoder's example of each token, 1, 2, ... (0 = padding)")
DECODER_TARGET_IDS = Field("target_ids", "BT", "int32", "the decoder's next token at each position")
DECODER_LOSS_MASK = Field("loss_mask", "BT", "int32", "1 = a decoder target that counts")
START_POSITIONS = Field("start_positions", "B", "int32",
                        "the answer's first token (0, the [CLS] token: no answer here)")
END_POSITIONS = Field("end_positions", "B", "int32", "the answer's last token")

_MLM = (INPUT_IDS, TOKEN_TYPE_IDS, ATTENTION_MASK, MASKED_LM_POSITIONS, MASKED_LM_IDS,
        MASKED_LM_WEIGHTS, NEXT_SENTENCE_LABELS)
_ENCODER = (INPUT_IDS, TOKEN_TYPE_IDS, ATTENTION_MASK)
_SEQ2SEQ = (INPUT_IDS, DOCUMENT_IDS, DECODER_INPUT_IDS, DECODER_DOCUMENT_IDS, DECODER_TARGET_IDS,
            DECODER_LOSS_MASK)


@dataclasses.dataclass(frozen=True)
class Objective:
  """Every fact about a training objective that code outside its own module needs: looked up
  once by name (`objective`) and asked, never compared as a string."""

  name: str
  # The fields of its batches.
  fields: tuple[Field, ...]
  # The model kind it trains (bertjax/models/families.py): encoder, decoder, encoder_decoder.
  trains: str
  # Its rows are BERT's masked-LM instances (pairs, full sentences or packed rows).
  masked_lm: bool = False
  # Only sentence pairs carry its labels (an NSP or SOP head trains on them).
  sentence_pairs: bool = False
  # Its pair labels say whether A and B were swapped (ALBERT's SOP), not whether B is random.
  sentence_order: bool = False
  # Span-boundary targets beside the masked-LM ones (SpanBERT's SBO).
  span_boundary: bool = False
  # A generator's samples replace the masked tokens; a discriminator tells which (ELECTRA).
  replaced_tokens: bool = False
  # Every position predicts the next token: every position reaches the vocabulary.
  causal: bool = False
  # An encoder-decoder's pre-training noise: "spans" (T5's span corruption, sentinels in the
  # source, the spans as the target) or "infilling" (BART's text infilling, the whole text as
  # the target); "" for the others.
  noise: str = ""
  # A fine-tuning task's objective: its task's rows and head (bertjax/finetune/registry.py).
  finetuning: bool = False

  @property
  def seq2seq(self) -> bool:
    """Its batches are an encoder's rows and a decoder's."""
    return self.trains == "encoder_decoder"

  @property
  def pretraining(self) -> bool:
    return not self.finetuning


_OBJECTIVES = (
    Objective("mlm_nsp", _MLM, "encoder", masked_lm=True, sentence_pairs=True),
    Objective("mlm_sop", _MLM, "encoder", masked_lm=True, sentence_pairs=True,
              sentence_order=True),
    Objective("mlm", _MLM, "encoder", masked_lm=True),
    Objective("mlm_sbo", _MLM + (SPAN_LEFT_POSITIONS, SPAN_RIGHT_POSITIONS, SPAN_OFFSETS),
              "encoder", masked_lm=True, span_boundary=True),
    Objective("rtd", _MLM, "encoder", masked_lm=True, replaced_tokens=True),
    Objective("causal_lm", (INPUT_IDS, TARGET_IDS, LOSS_MASK, DOCUMENT_IDS, POSITIONS),
              "decoder", causal=True),
    # Encoder-decoders (T5's span corruption, BART's denoising): the encoder's rows and the
    # decoder's, each with its examples' ids.
    Objective("span_corruption", _SEQ2SEQ, "encoder_decoder", noise="spans"),
    Objective("denoising", _SEQ2SEQ, "encoder_decoder", noise="infilling"),
    Objective("classification", _ENCODER + (CLASS_LABELS,), "encoder", finetuning=True),
    Objective("regression", _ENCODER + (SCORE_LABELS,), "encoder", finetuning=True),
    Objective("token_classification", _ENCODER + (TAG_LABELS,), "encoder", finetuning=True),
    Objective("question_answering", _ENCODER + (START_POSITIONS, END_POSITIONS), "encoder",
              finetuning=True),
    Objective("text_to_text", _SEQ2SEQ, "encoder_decoder", finetuning=True),
)
OBJECTIVES: dict[str, Objective] = {o.name: o for o in _OBJECTIVES}
# Objective -> its fields. Packed BERT rows (data.bert_instances="packed") add PACKED.
BATCHES: dict[str, tuple[Field, ...]] = {o.name: o.fields for o in _OBJECTIVES}
PACKED = (DOCUMENT_IDS, POSITIONS)


def objective(name: str) -> Objective:
  """The objective `name`, or a ValueError listing them."""
  if name not in OBJECTIVES:
    raise ValueError(f"unknown objective {name!r}; objectives: {', '.join(OBJECTIVES)}")
  return OBJECTIVES[name]


def is_masked_lm(name: str) -> bool:
  return objective(name).masked_lm


def fields(objective: str, packed: bool = False) -> tuple[Field, ...]:
  """The fields of a batch of `objective` (with `packed`: BERT's packed rows)."""
  spec = OBJECTIVES.get(objective)
  if spec is None:
    raise ValueError(f"no batch schema for objective {objective!r}; objectives: "
                     f"{', '.join(OBJECTIVES)}")
  return spec.fields + (PACKED if packed and spec.masked_lm else ())


def shape(field: Field, rows: int, length: int, predictions: int,
          decoder_length: int = 0) -> tuple[int, ...]:
  sizes = {"B": rows, "L": length, "P": predictions, "T": decoder_length}
  return tuple(sizes[d] for d in field.dims)


def abstract_batch(objective: str, rows: int, length: int, predictions: int = 0,
                   packed: bool = False, decoder_length: int = 0) -> dict[str, Any]:
  """The batch as jax.ShapeDtypeStructs: what an ahead-of-time compile is given."""
  import jax  # noqa: PLC0415 - bertjax.data loads no jax
  return {f.name: jax.ShapeDtypeStruct(shape(f, rows, length, predictions, decoder_length),
                                       np.dtype(f.dtype))
          for f in fields(objective, packed)}


def example_batch(objective: str, rows: int, length: int, predictions: int = 0, *,
                  vocab_size: int, mask_prob: float = 0.15, packed: bool = False,
                  seed: int = 0, decoder_length: int = 0) -> dict[str, np.ndarray]:
  """A batch with what real data has, for timing a step: random token ids, two segments,
  round(mask_prob·L) masked positions per row (at most P; padded slots weigh 0), random labels,
  one document per row with a loss on every token."""
  rng = np.random.RandomState(seed)
  ids = rng.randint(5, vocab_size, (rows, length)).astype(np.int32)
  masked = min(predictions, max(1, round(mask_prob * length)))
  positions = np.zeros((rows, predictions), np.int32)
  for row in range(rows):
    positions[row, :masked] = np.sort(rng.choice(np.arange(1, length - 1), masked,
                                                 replace=False))
  values = {
      "input_ids": ids,
      "token_type_ids": (np.arange(length) >= length // 2).astype(np.int32)[None].repeat(rows,
                                                                                          0),
      "attention_mask": np.ones((rows, length), np.int32),
      "document_ids": np.ones((rows, length), np.int32),
      "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
      "masked_lm_positions": positions,
      "masked_lm_ids": np.take_along_axis(ids, positions, axis=1),
      "masked_lm_weights": (np.arange(predictions) < masked).astype(np.float32)[None].repeat(
          rows, 0),
      # Each masked position its own one-token span, between its two neighbours.
      "span_left_positions": np.maximum(positions - 1, 0),
      "span_right_positions": np.minimum(positions + 1, length - 1),
      "span_offsets": (np.arange(predictions) < masked).astype(np.int32)[None].repeat(rows, 0),
      "next_sentence_labels": rng.randint(0, 2, (rows,)).astype(np.int32),
      "target_ids": np.roll(ids, -1, axis=1),
      "loss_mask": np.ones((rows, length), np.int32),
      "start_positions": rng.randint(0, length, (rows,)).astype(np.int32),
      "end_positions": rng.randint(0, length, (rows,)).astype(np.int32),
  }
  if DECODER_INPUT_IDS in fields(objective):
    targets = rng.randint(5, vocab_size, (rows, decoder_length)).astype(np.int32)
    ones = np.ones((rows, decoder_length), np.int32)
    values.update(decoder_input_ids=np.roll(targets, 1, axis=1), target_ids=targets,
                  decoder_document_ids=ones, loss_mask=ones)
  batch = {}
  for f in fields(objective, packed):
    if f.name == "labels":
      value = (rng.standard_normal(shape(f, rows, length, predictions)) if f.dtype == "float32"
               else rng.randint(0, 2, shape(f, rows, length, predictions)))
    else:
      value = values[f.name]
    batch[f.name] = np.asarray(value, f.dtype)
  return batch


def check(batch: Mapping[str, Any], objective: str, where: str = "the batch") -> None:
  """A ValueError naming every field of `batch` that the schema of `objective` lacks, every
  field it misses, and every field of another dtype or rank. Packed rows are told by their
  document ids."""
  packed = is_masked_lm(objective) and "document_ids" in batch
  want = {f.name: f for f in fields(objective, packed)}
  problems = [f"{name}: not a field of a {objective} batch" for name in batch
              if name not in want]
  problems += [f"{name}: missing ({f.doc})" for name, f in want.items() if name not in batch]
  for name, f in want.items():
    if name in batch:
      value = batch[name]
      if np.dtype(value.dtype) != np.dtype(f.dtype) or np.ndim(value) != len(f.dims):
        problems.append(f"{name}: {np.dtype(value.dtype)} of rank {np.ndim(value)}, the schema "
                        f"says {f.dtype} of rank {len(f.dims)} ({f.dims})")
  if problems:
    raise ValueError(f"{where} does not fit the {objective} batch schema "
                     f"(bertjax.data.schema): " + "; ".join(problems))
