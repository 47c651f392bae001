"""A synthetic, learnable token source — for tests and smoke runs, never for real training.

Text is a random walk on a fixed sparse Markov chain (each token has four likely successors),
so a model can learn it: MLM accuracy and NSP accuracy rise, LM loss falls. Every example is a
pure function of (seed, split, example index), so any process can build any rows of any
batch: the global batch is identical whatever the number of processes.

Token ids: 0 [PAD], 1 [UNK], 2 [CLS], 3 [SEP], 4 [MASK]; for GPT the last id is end-of-text.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bertjax.data.bert_instances import SPAN_BOUNDARY_FIELDS
from bertjax.data.schema import Objective, objective
from bertjax.data.span_masking import span_boundary_targets

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
NUM_SPECIAL = 5
_SUCCESSORS = 4
# mlm_sbo: the longest span offset given an SBO target (LoaderConfig.span_max_length's default).
SPAN_MAX_LENGTH = 10


@dataclasses.dataclass(frozen=True)
class SyntheticMarkov:
  """Batches for the `mlm_nsp`/`mlm`/`mlm_sop`/`mlm_sbo` (BERT) or `causal_lm` (GPT)
  objectives."""

  vocab_size: int
  seq_length: int
  objective: str
  max_predictions: int = 20
  mask_prob: float = 0.15
  seed: int = 0
  # Distinct word ids the chain walks on (small, so a tiny model learns it in minutes).
  num_words: int = 256

  def __post_init__(self) -> None:
    if self.vocab_size <= NUM_SPECIAL + _SUCCESSORS:
      raise ValueError(f"synthetic data needs vocab_size > {NUM_SPECIAL + _SUCCESSORS}")

  @property
  def _objective(self) -> Objective:
    return objective(self.objective)

  @property
  def _successors(self) -> np.ndarray:
    rng = np.random.default_rng([self.seed, 1234])
    return rng.integers(NUM_SPECIAL, self._last_word + 1,
                        size=(self.vocab_size, _SUCCESSORS))

  @property
  def _last_word(self) -> int:
    # GPT reserves the last id of the vocabulary for end-of-text.
    last = self.vocab_size - (2 if self._objective.causal else 1)
    return min(last, NUM_SPECIAL + self.num_words - 1)

  def _walk(self, rng: np.random.Generator, successors: np.ndarray, length: int,
            start: int | None = None) -> list[int]:
    token = int(rng.integers(NUM_SPECIAL, self._last_word + 1)) if start is None else start
    out = []
    for _ in range(length):
      out.append(token)
      token = int(successors[token, rng.choice(_SUCCESSORS, p=(0.55, 0.25, 0.15, 0.05))])
    return out

  def batch(self, step: int, rows: range, split: str = "train") -> dict[str, np.ndarray]:
    """Rows `rows` of global batch number `step` as numpy arrays."""
    successors = self._successors
    split_id = {"train": 0, "eval": 1}[split]
    examples = [self._example(np.random.default_rng([self.seed, split_id, step, row]),
                              successors) for row in rows]
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}

  def _example(self, rng: np.random.Generator, successors: np.ndarray) -> dict[str, np.ndarray]:
    if self._objective.causal:
      return self._gpt_example(rng, successors)
    return self._bert_example(rng, successors)

  def _bert_example(self, rng, successors) -> dict[str, np.ndarray]:
    body = self.seq_length - 3
    len_a = int(rng.integers(1, body))
    walk = self._walk(rng, successors, body + 1)
    a, b = walk[:len_a], walk[len_a:body]
    label = 0
    if self._objective.sentence_order:
      if rng.random() < 0.5:
        a, b, label = b, a, 1
    elif rng.random() < 0.5:
      b, label = self._walk(rng, successors, body - len_a), 1
    tokens = [CLS] + a + [SEP] + b + [SEP]
    segment = [0] * (len(a) + 2) + [1] * (len(b) + 1)
    candidates = [i for i, t in enumerate(tokens) if t not in (CLS, SEP)]
    num = min(self.max_predictions, max(1, round(len(tokens) * self.mask_prob)))
    positions = np.sort(rng.choice(candidates, size=num, replace=False))
    ids = np.array(tokens)
    labels = ids[positions].copy()
    for p in positions:
      r = rng.random()
      if r < 0.8:
        ids[p] = MASK
      elif r < 0.9:
        ids[p] = rng.integers(0, self.vocab_size)
    pad_p = self.max_predictions - num
    example = {
        "input_ids": ids.astype(np.int32),
        "token_type_ids": np.array(segment, np.int32),
        "attention_mask": np.ones(self.seq_length, np.int32),
        "masked_lm_positions": np.pad(positions, (0, pad_p)).astype(np.int32),
        "masked_lm_ids": np.pad(labels, (0, pad_p)).astype(np.int32),
        "masked_lm_weights": np.pad(np.ones(num, np.float32), (0, pad_p)),
        "next_sentence_labels": np.int32(label),
    }
    if self._objective.span_boundary:
      # Runs of adjacent masked positions are the spans (bertjax.data.span_masking).
      targets = span_boundary_targets(positions, len(tokens), SPAN_MAX_LENGTH)
      for name, values in zip(SPAN_BOUNDARY_FIELDS, targets):
        example[name] = np.pad(values, (0, pad_p))
    return example

  def _gpt_example(self, rng, successors) -> dict[str, np.ndarray]:
    eot = self.vocab_size - 1
    tokens, segments, positions = [], [], []
    doc = 1
    while len(tokens) < self.seq_length + 1:
      n = int(rng.integers(8, self.seq_length))
      words = self._walk(rng, successors, n) + [eot]
      tokens += words
      segments += [doc] * len(words)
      positions += list(range(len(words)))
      doc += 1
    tokens, segments = np.array(tokens), np.array(segments)
    n = self.seq_length
    # Predict token t+1 from tokens <= t, only within one document.
    return {
        "input_ids": tokens[:n].astype(np.int32),
        "target_ids": tokens[1:n + 1].astype(np.int32),
        "loss_mask": (segments[:n] == segments[1:n + 1]).astype(np.int32),
        "document_ids": segments[:n].astype(np.int32),
        "positions": np.array(positions[:n], np.int32),
    }
