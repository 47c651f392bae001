"""The training loop's cleanup, however the run ended: every part runs whatever the one before
raised, and the run ends with one error line. The guide: docs/training.md, 'Exit statuses'.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable
from typing import Any

from bertjax.checkpoints.train_state import CheckpointWriteError


def disk_full(error: BaseException | None) -> bool:
  return isinstance(error, OSError) and error.errno == errno.ENOSPC


class Shutdown:
  """Runs the cleanup's parts, keeping their failures, inside the loop's `finally`."""

  def __init__(self) -> None:
    self.ending = sys.exc_info()[1]  # the error the run is ending with (None: it finished)
    self.failures: list[Exception] = []

  def run(self, part: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`part(...)`'s result, or None when it failed (the failure kept)."""
    try:
      return part(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the other parts still run; error() chooses
      self.failures.append(e)
      return None

  @property
  def write_failed(self) -> bool:
    """A checkpoint write failed: the store is full or gone."""
    return any(isinstance(e, CheckpointWriteError) for e in (self.ending, *self.failures))

  def error(self) -> Exception | None:
    """The error to raise now; None when the one on its way out stands (or nothing failed).
    That one stands unless it is a full disk's and a checkpoint write failed too: a metrics
    or ledger write often finds the disk full before the background checkpoint write that
    filled it reports, and the checkpoint's line names the step and the directory. Without
    one on its way out, a checkpoint's failure comes first, then the first other."""
    written = next((e for e in self.failures if isinstance(e, CheckpointWriteError)), None)
    if self.ending is not None:
      return written if written is not None and disk_full(self.ending) else None
    return written if written is not None else next(iter(self.failures), None)
