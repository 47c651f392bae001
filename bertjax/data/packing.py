"""Packing documents into fixed-length sequences, as checkpointable Grain iterators:
`GptPackIterDataset` (windows of seq_length + 1 tokens overlapping by one, no padding),
`FullSentencesIterDataset` (RoBERTa's FULL-SENTENCES), `DocSentencesIterDataset` (its
DOC-SENTENCES, SpanBERT's single segments), `PackedMlmIterDataset` (ModernBERT's packed
MLM rows) and `WindowShuffleIterDataset` (a cheap shuffle within windows); what each row holds:
docs/data.md, 'The loader'.

A packer keeps only the parent's state before the document where the next sequence starts and
an offset into it: restoring re-reads that document and continues exactly, no buffer saved.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from bertjax.data.bert_instances import Instance, InstanceConfig, SpecialIds, mask_tokens
from bertjax.data.records import TokenizedDocument


@dataclasses.dataclass(frozen=True)
class DocumentElement:
  """A document as the loader streams it."""

  ordinal: int  # position in the global document order (unique, seeds the masks)
  epoch: int  # the pass through its own source this document is read in (0, 1, ...)
  index: int  # index in the unshuffled source (BERT's "random other document")
  doc: TokenizedDocument
  # A piece of a document that goes on in another piece (token-balanced rows cut the longest
  # documents, bertjax.data.balance): GPT packing ends it without an end-of-text token.
  continued: bool = False


class BufferedDocuments(grain.DatasetIterator):
  """A packer's state: the documents it has buffered (each with the parent's state before it,
  first), the tokens of the first already consumed, and the parent's state before the first.
  Only the last two are saved; restoring re-reads the documents."""

  def __init__(self, parent: grain.DatasetIterator):
    super().__init__(parent)
    self._docs: collections.deque = collections.deque()  # (parent state before, ..., tokens)
    self._offset = 0  # tokens of the first buffered document already consumed
    self._start_state = self._parent.get_state()

  def get_state(self) -> dict[str, Any]:
    return {"parent": self._start_state, "offset": self._offset}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._start_state = state["parent"]
    self._docs.clear()
    self._offset = state["offset"]

  def _pieces(self, n: int) -> list[np.ndarray]:
    """The next (at most) `n` buffered tokens from the offset, one piece per document."""
    pieces, offset, taken = [], self._offset, 0
    for *_, tokens in self._docs:
      pieces.append(tokens[offset:offset + n - taken])
      taken += len(pieces[-1])
      offset = 0
      if taken == n:
        break
    return pieces

  def _advance(self, n: int) -> None:
    """Past `n` tokens: fully read documents leave the buffer; the state moves to the first
    document still buffered (or the parent's next)."""
    self._offset += n
    while self._docs and self._offset >= len(self._docs[0][-1]):
      self._offset -= len(self._docs[0][-1])
      self._docs.popleft()
    self._start_state = self._docs[0][0] if self._docs else self._parent.get_state()


class _GptPackIterator(BufferedDocuments):
  # Buffered documents: (parent state before, tokens + eot).

  def __init__(self, parent: grain.DatasetIterator, seq_length: int, eot: int):
    super().__init__(parent)
    self._n = seq_length
    self._eot = eot

  def _fill(self, need: int) -> None:
    available = sum(len(t) for _, t in self._docs) - self._offset
    while available < need:
      state = self._parent.get_state()
      element: DocumentElement = next(self._parent)
      tokens = (element.doc.tokens if element.continued else
                np.append(element.doc.tokens, np.int32(self._eot))).astype(np.int32)
      self._docs.append((state, tokens))
      available += len(tokens)

  def __next__(self) -> dict[str, np.ndarray]:
    n = self._n
    self._fill(n + 1)
    pieces = self._pieces(n + 1)
    window = np.concatenate(pieces)
    segments = np.concatenate([np.full(len(p), i + 1, np.int32) for i, p in enumerate(pieces)])
    positions = np.concatenate([np.arange(len(p), dtype=np.int32) for p in pieces])
    # Advance by n tokens: the last target token starts the next window.
    self._advance(n)
    return {
        "input_ids": window[:n],
        "target_ids": window[1:],
        "loss_mask": (segments[:n] == segments[1:]).astype(np.int32),
        "document_ids": segments[:n],
        "positions": positions[:n],
    }


class GptPackIterDataset(grain.IterDataset):

  def __init__(self, parent: grain.IterDataset, seq_length: int, eot: int):
    super().__init__(parent)
    self._seq_length, self._eot = seq_length, eot

  def __iter__(self) -> _GptPackIterator:
    return _GptPackIterator(self._parent.__iter__(), self._seq_length, self._eot)


class _FullSentencesIterator(grain.DatasetIterator):
  # Whether a sequence continues into the next document (FULL-SENTENCES) or ends with its
  # document (DOC-SENTENCES).
  _cross_documents = True

  def __init__(self, parent: grain.DatasetIterator, cfg: InstanceConfig, special: SpecialIds,
               is_continuation: Callable[[int], bool], seed: int):
    super().__init__(parent)
    self._cfg, self._special, self._is_continuation = cfg, special, is_continuation
    self._seed = seed
    self._state = self._parent.get_state()  # before the current document
    self._element: DocumentElement | None = None
    self._sentences: list[list[int]] = []
    self._sentence = 0  # next sentence of the current document
    self._token = 0  # next token of that sentence (a sentence longer than a sequence is cut)

  def _next_document(self) -> None:
    self._state = self._parent.get_state()
    self._element = next(self._parent)
    self._sentences = self._element.doc.sentences()
    self._sentence = self._token = 0

  def __next__(self) -> dict[str, np.ndarray]:
    budget = self._cfg.max_seq_length - 2  # [CLS] ... [SEP]
    if self._element is None or self._sentence >= len(self._sentences):
      self._next_document()
    # The mask's seed: where this sequence starts in the global document stream.
    rng = random.Random(f"{self._seed}:{self._element.ordinal}:{self._sentence}:{self._token}")
    body: list[int] = []
    while True:
      sentence = self._sentences[self._sentence][self._token:]
      if len(sentence) > budget - len(body):
        if body:
          break  # whole sentences only: this one starts the next sequence
        body = list(sentence[:budget])  # a sentence longer than a sequence is cut
        self._token += budget
        break
      body.extend(sentence)
      self._sentence += 1
      self._token = 0
      if self._sentence == len(self._sentences):
        if len(body) >= budget or not self._cross_documents:
          break
        body.append(self._special.sep)  # RoBERTa: an extra separator between documents
        try:
          self._next_document()
        except StopIteration:
          self._element = None
          break
    if body[-1] == self._special.sep:
      body.pop()  # the document separator is not needed at the end of a sequence
    tokens = [self._special.cls] + body + [self._special.sep]
    masked, positions, labels = mask_tokens(tokens, self._cfg, self._special,
                                            self._is_continuation, rng)
    instance = Instance(masked, [0] * len(tokens), False, positions, labels)
    return instance.features(self._cfg, self._special.pad)

  def get_state(self) -> dict[str, Any]:
    if self._element is None:
      return {"parent": self._parent.get_state(), "sentence": 0, "token": 0}
    return {"parent": self._state, "sentence": self._sentence, "token": self._token}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._element = None
    if state["sentence"] or state["token"]:
      self._next_document()
      self._sentence, self._token = state["sentence"], state["token"]


class _MlmPackerIterDataset(grain.IterDataset):
  """A packer of masked documents into rows: its iterator class reads the parent's documents
  with the instance config, special ids, word-continuation rule and seed."""

  _iterator: type[grain.DatasetIterator]

  def __init__(self, parent: grain.IterDataset, cfg: InstanceConfig, special: SpecialIds,
               is_continuation: Callable[[int], bool], seed: int):
    super().__init__(parent)
    self._args = (cfg, special, is_continuation, seed)

  def __iter__(self) -> grain.DatasetIterator:
    return self._iterator(self._parent.__iter__(), *self._args)


class FullSentencesIterDataset(_MlmPackerIterDataset):
  """RoBERTa FULL-SENTENCES rows (see the module docstring)."""

  _iterator = _FullSentencesIterator


class _DocSentencesIterator(_FullSentencesIterator):
  _cross_documents = False


class DocSentencesIterDataset(_MlmPackerIterDataset):
  """RoBERTa DOC-SENTENCES rows: whole sentences of one document up to seq_length, a sentence
  longer than a sequence cut; a document's last sequence may be short. SpanBERT's single
  segments ("sequences of up to 512 tokens until it reaches a document boundary")."""

  _iterator = _DocSentencesIterator


class _PackedMlmIterator(BufferedDocuments):
  # Buffered documents: (parent state before, ordinal, [CLS] tokens [SEP]).

  def __init__(self, parent: grain.DatasetIterator, cfg: InstanceConfig, special: SpecialIds,
               is_continuation: Callable[[int], bool], seed: int):
    super().__init__(parent)
    self._cfg, self._special, self._is_continuation = cfg, special, is_continuation
    self._seed = seed

  def _fill(self, need: int) -> None:
    """Buffers documents until `need` tokens are available, or the parent runs out."""
    available = sum(len(t) for _, _, t in self._docs) - self._offset
    while available < need:
      state = self._parent.get_state()
      try:
        element: DocumentElement = next(self._parent)
      except StopIteration:
        return
      tokens = np.concatenate([[self._special.cls], element.doc.tokens,
                               [self._special.sep]]).astype(np.int32)
      self._docs.append((state, element.ordinal, tokens))
      available += len(tokens)

  def __next__(self) -> dict[str, np.ndarray]:
    n = self._cfg.max_seq_length
    self._fill(n)
    if not self._docs:
      raise StopIteration
    # The mask's seed: where this row starts in the global document stream.
    rng = random.Random(f"{self._seed}:{self._docs[0][1]}:{self._offset}")
    pieces = self._pieces(n)
    row = np.concatenate(pieces)
    taken = len(row)
    self._advance(taken)  # past the row
    masked, positions, labels = mask_tokens(row.tolist(), self._cfg, self._special,
                                            self._is_continuation, rng)
    features = Instance(masked, [0] * taken, False, positions, labels).features(
        self._cfg, self._special.pad)
    pad = np.zeros(n - taken, np.int32)
    features["document_ids"] = np.concatenate(
        [np.full(len(p), i + 1, np.int32) for i, p in enumerate(pieces)] + [pad])
    features["positions"] = np.concatenate(
        [np.arange(len(p), dtype=np.int32) for p in pieces] + [pad])
    return features


class PackedMlmIterDataset(_MlmPackerIterDataset):
  """ModernBERT-style packed MLM rows (see the module docstring). State: the parent's position
  before the document where the next row starts and the offset into its [CLS] tokens [SEP]."""

  _iterator = _PackedMlmIterator


class _WindowShuffleIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, window_size: int,
               seed: int | tuple[int, ...]):
    super().__init__(parent)
    self._size = window_size
    self._seed = tuple(seed) if isinstance(seed, (tuple, list)) else (seed,)
    self._window: list = []
    self._window_index = -1
    self._start_state = self._parent.get_state()
    self._taken = 0  # elements of the current window already returned

  def _fill(self) -> None:
    self._start_state = self._parent.get_state()
    self._window_index += 1
    self._window = []
    for _ in range(self._size):
      try:
        self._window.append(next(self._parent))
      except StopIteration:
        break
    order = np.random.default_rng([*self._seed, self._window_index]).permutation(
        len(self._window))
    self._window = [self._window[i] for i in order[::-1]]  # popped from the end
    self._taken = 0

  def __next__(self) -> Any:
    if not self._window:
      self._fill()
      if not self._window:
        raise StopIteration
    self._taken += 1
    return self._window.pop()

  def get_state(self) -> dict[str, Any]:
    if not self._window:  # between windows: the next one starts at the parent's position
      return {"parent": self._parent.get_state(), "window": self._window_index + 1, "taken": 0}
    return {"parent": self._start_state, "window": self._window_index, "taken": self._taken}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._window_index = state["window"] - 1
    self._window = []
    if state["taken"]:
      self._fill()
      del self._window[len(self._window) - state["taken"]:]
      self._taken = state["taken"]  # _fill reset it: the next state must count these too


class WindowShuffleIterDataset(grain.IterDataset):
  """Shuffles elements within consecutive windows (the pairs of one document apart).

  Grain's own WindowShuffleIterDataset costs ~35 µs per element on this machine (a seeded
  index permutation call and stats bookkeeping per element), a seventh of the per-instance
  budget; this one draws one numpy permutation per window. State: the parent's position at the
  window start, the window number and how many were taken."""

  def __init__(self, parent: grain.IterDataset, window_size: int,
               seed: int | tuple[int, ...]):
    super().__init__(parent)
    self._window_size, self._seed = window_size, seed

  def __iter__(self) -> _WindowShuffleIterator:
    return _WindowShuffleIterator(self._parent.__iter__(), self._window_size, self._seed)
