"""Bad input: errors that name the file and position, and counted skips.

Every data stage either raises `CorpusError` (the input cannot be used: the message says which
file and where) or counts what it skipped, by reason, in `SkipCounts` (never a silent loss).
"""

from __future__ import annotations

import collections
import dataclasses


class CorpusError(ValueError):
  """Input that cannot be read; the message names the file and the position."""


@dataclasses.dataclass
class SkipCounts:
  """What a stage skipped, counted by reason (printed in build summaries)."""

  counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def add(self, reason: str) -> None:
    self.counts[reason] += 1

  def summary(self) -> str:
    return ", ".join(f"{reason}: {n}" for reason, n in sorted(self.counts.items())) or "none"
