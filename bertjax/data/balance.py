"""Token-balanced rows (`data.row_balance="tokens"`): which global batch row reads which document
of each epoch, so that the rows run out together and a finite run ends with nearly everything
delivered.

Each epoch's items (documents, or nearly equal token pieces of a long one) go, heaviest first,
to the row with the least so far (Graham's LPT rule), weighed by what the row consumes. The
assignment depends on the epoch's order and token counts only, so every host and loader worker
computes the same one.

The guide: docs/data.md, 'Balanced epochs'.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable

import grain
import numpy as np

from bertjax.data import records
from bertjax.data.packing import DocumentElement


def assign_rows(lengths: np.ndarray, num_rows: int) -> np.ndarray:
  """The row of each item (in order): longest first to the row with the fewest tokens so
  far; ties go to the earlier item and the lower row."""
  lengths = np.asarray(lengths, np.int64)
  order = np.lexsort((np.arange(len(lengths)), -lengths))
  heap = [(0, r) for r in range(num_rows)]
  rows = np.empty(len(lengths), np.int32)
  for i in order.tolist():
    load, r = heapq.heappop(heap)
    rows[i] = r
    heapq.heappush(heap, (load + int(lengths[i]), r))
  return rows


def piece_bounds(num_tokens: int, pieces: int) -> np.ndarray:
  """Where a document of `num_tokens` is cut into `pieces` nearly equal pieces: piece k is
  tokens [bounds[k], bounds[k + 1])."""
  return np.arange(pieces + 1, dtype=np.int64) * num_tokens // pieces


@dataclasses.dataclass(frozen=True)
class Piece:
  position: int  # in the global document order
  piece: int  # which piece of the document (0-based)
  pieces: int  # how many it is cut into (1: whole)


class BalancedRows:
  """Row r's documents, epoch after epoch: `item(row, k)` is the k-th document (or piece of
  one) row r reads. `epoch_lengths(epoch)` gives the token counts of an epoch's documents in
  global order (`epoch_documents` of them); rows are balanced by what they read, by default
  tokens, else `weigh(positions, piece, pieces, tokens)` of the epoch's items (what a row
  consumes per item: its tokens, or the sequences made of it). A document longer than an
  eighth of a row's share of the epoch (and than `min_piece`) is cut into pieces of about
  that size, dealt apart: no single document can leave one row far longer than the others."""

  def __init__(self, epoch_lengths: Callable[[int], np.ndarray], epoch_documents: int,
               num_rows: int, num_epochs: int, min_piece: int,
               weigh: Callable[..., np.ndarray] | None = None):
    self._epoch_lengths, self._weigh = epoch_lengths, weigh
    self._n, self._rows, self._num_epochs = epoch_documents, num_rows, num_epochs
    self._min_piece = min_piece
    self._counts: dict[int, np.ndarray] = {}  # epoch -> items per row
    # epoch -> each row's items (positions, piece, pieces); the last few epochs only (rows
    # cross an epoch's end at different steps, so two are read at once).
    self._cached: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

  def __getstate__(self) -> dict:
    return {**self.__dict__, "_cached": {}}  # workers recompute what they read

  def _items(self, epoch: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each row's items of epoch `epoch`, in the epoch's order."""
    if epoch not in self._cached:
      lengths = np.asarray(self._epoch_lengths(epoch), np.int64)
      max_piece = max(self._min_piece, int(lengths.sum()) // (8 * self._rows))
      pieces = np.maximum(1, -(-lengths // max_piece))
      doc = np.repeat(np.arange(len(lengths)), pieces)
      first = np.cumsum(pieces) - pieces
      piece = np.arange(len(doc)) - first[doc]
      sizes = ((piece + 1) * lengths[doc] // pieces[doc]) - (piece * lengths[doc] // pieces[doc])
      weights = (sizes if self._weigh is None else
                 self._weigh(epoch * self._n + doc, piece, pieces[doc], sizes))
      rows = assign_rows(weights, self._rows)
      per_row = np.bincount(rows, minlength=self._rows)
      by_row = np.argsort(rows, kind="stable")
      ends = np.cumsum(per_row)
      items = []
      for b, c in zip(ends, per_row):
        mine = by_row[b - c:b]
        items.append((epoch * self._n + doc[mine], piece[mine], pieces[doc[mine]]))
      self._cached[epoch] = items
      self._counts[epoch] = per_row
      while len(self._cached) > 3:
        del self._cached[next(iter(self._cached))]  # the longest held
    return self._cached[epoch]

  def _count(self, epoch: int, row: int) -> int:
    if epoch not in self._counts:
      self._items(epoch)
    return int(self._counts[epoch][row])

  def items_of_row(self, row: int) -> int | None:
    """How many items row `row` reads in all (None: endless)."""
    if not self._num_epochs:
      return None
    return sum(self._count(e, row) for e in range(self._num_epochs))

  def item(self, row: int, k: int) -> Piece:
    """Row `row`'s k-th item (0-based, across epochs)."""
    epoch = 0
    while True:
      if self._num_epochs and epoch >= self._num_epochs:
        raise IndexError(f"row {row} has no item {k}")
      count = self._count(epoch, row)
      if k < count:
        positions, piece, pieces = self._items(epoch)[row]
        return Piece(int(positions[k]), int(piece[k]), int(pieces[k]))
      k -= count
      epoch += 1


class EpochTokens:
  """The token counts of one epoch's documents in global order (what `BalancedRows` deals
  by)."""

  def __init__(self, counts: grain.MapDataset, epoch_documents: int):
    self._counts, self._n = counts, epoch_documents

  def __call__(self, epoch: int) -> np.ndarray:
    start = epoch * self._n
    return np.fromiter((self._counts[start + i] for i in range(self._n)), np.int64, self._n)


class RowItems:
  """A balanced row's documents (and pieces of them) from the global order `documents`: k ->
  its k-th item."""

  def __init__(self, documents: grain.MapDataset, balanced: BalancedRows, row: int):
    self._documents, self._balanced, self._row = documents, balanced, row

  def __call__(self, k: int) -> tuple[int, DocumentElement] | None:
    item = self._balanced.item(self._row, k)
    found = self._documents[item.position]
    if found is None:  # a corrupt record, skipped (bertjax.data.mixture): left out here too
      return None
    number, element = found
    if item.pieces == 1:
      return number, element
    return number, piece_of(element, item.piece, item.pieces)


# A piece after a document's first seeds its masks as if at this far a position (the global
# order's positions stay far below it), so that no two pieces share a seed.
_PIECE_ORDINAL_STRIDE = 2**40


def piece_of(element: DocumentElement, piece: int, pieces: int) -> DocumentElement:
  """Piece `piece` of `pieces` of a document (balance.piece_bounds: nearly equal token
  ranges; a sentence crossing a cut is cut too). Its key says which piece; all but the last
  are `continued` (GPT packing gives them no end-of-text token)."""
  doc = element.doc
  lo, hi = piece_bounds(len(doc.tokens), pieces)[piece:piece + 2]
  ends = np.cumsum(doc.sentence_lengths, dtype=np.int64)
  lengths = np.clip(ends, lo, hi) - np.clip(ends - doc.sentence_lengths, lo, hi)
  part = records.TokenizedDocument(f"{doc.key}#{piece + 1}/{pieces}",
                                   lengths[lengths > 0].astype(np.int32), doc.tokens[lo:hi])
  return DocumentElement(element.ordinal + piece * _PIECE_ORDINAL_STRIDE, element.epoch,
                         element.index, part, continued=piece < pieces - 1)
