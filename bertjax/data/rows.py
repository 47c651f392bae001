"""Batches that are a pure function of their number (`NumberedBatches`: the iterator's state is
the batch number, so a restored run continues with the same batches), and `EpochBatches`: rows
held in memory (a fine-tuning task's training rows), epoch after epoch.

Every process holds all rows and takes its own rows of each global batch. Each epoch visits the
rows in a fresh random order, the next permutation drawn from one `RandomState(seed)`; an
epoch's last batch is filled up from the epoch's start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Rows = Mapping[str, np.ndarray]


class NumberedBatches:
  """A checkpointable iterator over `batch(number)`, number 0, 1, 2, ..."""

  _step = 0

  def batch(self, number: int) -> dict[str, np.ndarray]:
    raise NotImplementedError

  def __iter__(self) -> NumberedBatches:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = self.batch(self._step)
    self._step += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"step": self._step}

  def set_state(self, state: Mapping[str, Any]) -> None:
    self._step = int(state["step"])

  def close(self) -> None:
    pass


class EpochBatches(NumberedBatches):
  """This process's rows `local_rows` of each global batch of `batch_size` rows."""

  def __init__(self, rows: Rows, batch_size: int, seed: int, local_rows: Sequence[int]):
    self._rows = rows
    self._count = len(next(iter(rows.values())))
    if not self._count:
      raise ValueError("no training rows")
    self._batch_size = batch_size
    self._seed = seed
    self._local = np.asarray(local_rows)
    self.steps_per_epoch = math.ceil(self._count / batch_size)
    self._rng, self._epoch, self._current = np.random.RandomState(seed), -1, None

  def _order(self, epoch: int) -> np.ndarray:
    if epoch < self._epoch:  # an earlier epoch (a restore): the draws again from the start
      self._rng, self._epoch = np.random.RandomState(self._seed), -1
    while self._epoch < epoch:
      self._current = self._rng.permutation(self._count)
      self._epoch += 1
    return self._current

  def global_indices(self, step: int) -> np.ndarray:
    """The rows of global batch `step` (0-based), in batch order."""
    epoch, b = divmod(step, self.steps_per_epoch)
    order = self._order(epoch)
    return order[np.arange(b * self._batch_size, (b + 1) * self._batch_size) % self._count]

  def batch(self, number: int) -> dict[str, np.ndarray]:
    idx = self.global_indices(number)[self._local]
    return {k: v[idx] for k, v in self._rows.items()}
