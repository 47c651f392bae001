"""The encoder-decoders' examples, as checkpointable Grain iterators over a row's documents:
`SpanCorruptionIterDataset` (T5: runs of `t5_lengths` raw tokens, corrupted, filling the encoder
and the decoder exactly) and `DenoisingIterDataset` (BART: blocks of sentences, permuted and
infilled, one per row). The noise is bertjax.data.denoising's, seeded by the example's place in
the global document stream, so examples do not depend on the host count and a restored state
repeats them. `specials` is a t5- or bart-style tokenizer's frame.

The guide: docs/data.md, 'Encoder-decoder examples'; the fields: 'Batches: one schema'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from bertjax.data import denoising
from bertjax.data.errors import CorpusError
from bertjax.data.options import LoaderConfig
from bertjax.data.packing import BufferedDocuments, DocumentElement
from bertjax.data.schema import objective
from bertjax.data.span_masking import continuations
from bertjax.data.tokenizers import special_ids


@dataclasses.dataclass(frozen=True)
class Specials:
  """An encoder-decoder tokenizer's frame: `bos` (BART's <s>; None for T5) and `eos` around a
  text, `pad`, and the decoder's start token (transformers' decoder_start_token_id)."""

  bos: int | None
  eos: int
  pad: int
  start: int

  def wrap(self, ids: Sequence[int], length: int | None = None) -> tuple[list[int], bool]:
    """`ids` between bos and eos, cut on the right to `length` tokens (None: uncut); and
    whether cut."""
    room = len(ids) if length is None else max(0, length - 1 - (self.bos is not None))
    head = [self.bos] if self.bos is not None else []
    return head + list(ids[:room]) + [self.eos], len(ids) > room


# Used by text-to-text fine-tuning, `bertjax generate` and the exports' config.json.
def specials(tokenizer: Any) -> Specials:
  """The frame of a t5- or bart-style tokenizer (a ValueError for any other)."""
  ids = special_ids(tokenizer)
  if ids.get("eos") is None or ids.get("pad") is None:
    raise ValueError("an encoder-decoder needs its t5- or bart-style tokenizer (with </s> and "
                     "<pad>): bertjax tokenizer train --style t5 (or bart)")
  bos = ids.get("bos")
  return Specials(bos, ids["eos"], ids["pad"], ids["pad"] if bos is None else ids["eos"])


@dataclasses.dataclass(frozen=True)
class Seq2SeqConfig:
  """What the encoder-decoder examples need from the loader config and the tokenizer."""

  seq_length: int  # the encoder's length (T5: inputs_length)
  eos: int
  pad: int
  seed: int
  # T5: noise density and mean span length; the first sentinel (<extra_id_0>), counting down.
  noise_density: float = 0.15
  mean_noise_span_length: float = 3.0
  first_sentinel: int = -1
  # BART: the fraction of words in infilled spans, the Poisson mean of their lengths, <s> and
  # <mask>.
  mask_ratio: float = 0.3
  poisson_lambda: float = 3.0
  bos: int = -1
  mask: int = -1

  @property
  def t5_lengths(self) -> tuple[int, int]:
    """(raw tokens per example, decoder length)."""
    return denoising.t5_lengths(self.seq_length, self.noise_density,
                                self.mean_noise_span_length)

  def decoder_length(self, name: str) -> int:
    """The decoder's length for the objective `name`: T5's target length for span corruption,
    the whole text's for BART's infilling."""
    return self.t5_lengths[1] if objective(name).noise == "spans" else self.seq_length


def seq2seq_config(tokenizer: Any, cfg: LoaderConfig, seed: int) -> Seq2SeqConfig:
  """The encoder-decoder examples' settings; the tokenizer must have its model's special
  tokens (T5: </s> and the sentinels; BART: <s>, </s> and <mask>)."""
  ids = special_ids(tokenizer)
  t5 = objective(cfg.objective).noise == "spans"
  first_sentinel = getattr(tokenizer, "first_sentinel", None)
  needed = {"eos": ids.get("eos"), "pad": ids.get("pad")} | (
      {"<extra_id_0>": first_sentinel} if t5 else {"bos": ids.get("bos"), "mask": ids.get("mask")})
  missing = [k for k, v in needed.items() if v is None]
  if missing:
    raise CorpusError(f"objective {cfg.objective} needs a {'t5' if t5 else 'bart'}-style "
                      f"tokenizer; the dataset's lacks {', '.join(missing)} (train one with "
                      f"bertjax tokenizer train --style {'t5' if t5 else 'bart'})")
  return Seq2SeqConfig(
      seq_length=cfg.seq_length, eos=ids["eos"], pad=ids["pad"], seed=seed,
      noise_density=cfg.mask_prob, mean_noise_span_length=cfg.noise_span_length,
      first_sentinel=first_sentinel if t5 else -1, mask_ratio=cfg.mask_prob,
      poisson_lambda=cfg.noise_span_length, bos=-1 if t5 else ids["bos"],
      mask=-1 if t5 else ids["mask"])


def _example(inputs: list[int] | np.ndarray, targets: list[int] | np.ndarray, start: int,
             length: int, target_length: int, pad: int) -> dict[str, np.ndarray]:
  """The fields of one example, padded to the encoder's and the decoder's lengths."""
  def padded(values, size):
    out = np.full(size, pad, np.int32)
    out[:len(values)] = values
    real = np.zeros(size, np.int32)
    real[:len(values)] = 1
    return out, real
  input_ids, document_ids = padded(inputs, length)
  target_ids, loss_mask = padded(targets, target_length)
  decoder_input_ids, _ = padded(np.concatenate([[start], np.asarray(targets)[:-1]]),
                                target_length)
  return {"input_ids": input_ids, "document_ids": document_ids,
          "decoder_input_ids": decoder_input_ids, "decoder_document_ids": loss_mask.copy(),
          "target_ids": target_ids, "loss_mask": loss_mask}


class _SpanCorruptionIterator(BufferedDocuments):
  # Buffered documents: (parent state before, ordinal, tokens + </s>).

  def __init__(self, parent: grain.DatasetIterator, cfg: Seq2SeqConfig):
    super().__init__(parent)
    self._cfg = cfg
    self._raw, self._targets = cfg.t5_lengths

  def _fill(self, need: int) -> None:
    available = sum(len(t) for *_, t in self._docs) - self._offset
    while available < need:
      state = self._parent.get_state()
      element: DocumentElement = next(self._parent)
      tokens = (element.doc.tokens if element.continued else
                np.append(element.doc.tokens, self._cfg.eos)).astype(np.int32)
      self._docs.append((state, element.ordinal, tokens))
      available += len(tokens)

  def __next__(self) -> dict[str, np.ndarray]:
    cfg, n = self._cfg, self._raw
    self._fill(n)
    # The noise's seed: where this example starts in the global document stream.
    rng = np.random.default_rng([cfg.seed, self._docs[0][1], self._offset])
    tokens = np.concatenate(self._pieces(n))
    self._advance(n)
    mask = denoising.random_spans_noise_mask(n, cfg.noise_density, cfg.mean_noise_span_length,
                                             rng)
    inputs, targets = denoising.span_corruption(tokens, mask, cfg.first_sentinel)
    return _example(np.append(inputs, cfg.eos), np.append(targets, cfg.eos), cfg.pad,
                    cfg.seq_length, self._targets, cfg.pad)


class SpanCorruptionIterDataset(grain.IterDataset):

  def __init__(self, parent: grain.IterDataset, cfg: Seq2SeqConfig):
    super().__init__(parent)
    self._cfg = cfg

  def __iter__(self) -> _SpanCorruptionIterator:
    return _SpanCorruptionIterator(self._parent.__iter__(), self._cfg)


def sentence_blocks(sentences: list[list[int]], budget: int) -> list[list[list[int]]]:
  """Whole sentences in blocks of at most `budget` tokens (a longer sentence is cut into
  budget-sized pieces, each its own block)."""
  blocks: list[list[list[int]]] = []
  current: list[list[int]] = []
  size = 0
  for sentence in sentences:
    while len(sentence) > budget:
      if current:
        blocks.append(current)
        current, size = [], 0
      blocks.append([sentence[:budget]])
      sentence = sentence[budget:]
    if size + len(sentence) > budget and current:
      blocks.append(current)
      current, size = [], 0
    if sentence:
      current.append(sentence)
      size += len(sentence)
  if current:
    blocks.append(current)
  return blocks


class _DenoisingIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, cfg: Seq2SeqConfig,
               is_continuation: Callable[[int], bool]):
    super().__init__(parent)
    self._cfg, self._is_continuation = cfg, is_continuation
    self._state = self._parent.get_state()  # before the current document
    self._element: DocumentElement | None = None
    self._blocks: list[list[list[int]]] = []
    self._block = 0

  def _read(self) -> None:
    self._element = next(self._parent)
    self._blocks = sentence_blocks(self._element.doc.sentences(), self._cfg.seq_length - 2)

  def __next__(self) -> dict[str, np.ndarray]:
    cfg = self._cfg
    while self._element is None or self._block >= len(self._blocks):
      self._state = self._parent.get_state()
      self._read()
      self._block = 0
    rng = np.random.default_rng([cfg.seed, self._element.ordinal, self._block])
    block = self._blocks[self._block]
    self._block += 1
    original = [t for sentence in block for t in sentence]
    source = np.asarray([t for s in denoising.permute_sentences(block, rng) for t in s],
                        np.int32)
    starts = ~continuations(source, self._is_continuation)
    noised = denoising.text_infilling(source, rng, cfg.mask, cfg.mask_ratio,
                                      cfg.poisson_lambda, starts)[:cfg.seq_length - 2]
    return _example([cfg.bos, *noised.tolist(), cfg.eos], [cfg.bos, *original, cfg.eos],
                    cfg.eos, cfg.seq_length, cfg.seq_length, cfg.pad)

  def get_state(self) -> dict[str, Any]:
    return {"parent": self._state, "block": self._block if self._element is not None else 0}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._state = state["parent"]
    self._element, self._block = None, 0
    if state["block"]:
      self._read()
      self._block = state["block"]


class DenoisingIterDataset(grain.IterDataset):

  def __init__(self, parent: grain.IterDataset, cfg: Seq2SeqConfig,
               is_continuation: Callable[[int], bool]):
    super().__init__(parent)
    self._cfg, self._is_continuation = cfg, is_continuation

  def __iter__(self) -> _DenoisingIterator:
    return _DenoisingIterator(self._parent.__iter__(), self._cfg, self._is_continuation)
