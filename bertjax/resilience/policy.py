"""What a run decides about trouble the spike guard reports, and the record of it.

The guard (bertjax.resilience.guard) skips single outlier updates inside the step; its alarm
(several skips within a window, or a non-finite step) reaches the host with the step's metrics
(`Policy.observe`). The loop then replays the steps from the last checkpoint before the trouble
(bertjax.training.recovery): trouble that does not come back is a hardware fault
(`HardwareFault`, exit status 5); trouble that does makes the run rewind to that checkpoint and
skip the batches it trained on since, up to `max_rewinds` times (`GaveUp`). Every decision is
a line of WORKDIR/resilience.jsonl; a resumed run reads them to draw the same batches.

The guide: docs/resilience.md, 'Rewind and skip'.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections

from bertjax import paths
from bertjax.resilience.guard import GuardSettings
from bertjax.resilience.ledger import Ledger

log = logging.getLogger(__name__)

EVENTS = "resilience.jsonl"


class HardwareFault(RuntimeError):
  """Trouble that a replay of the same steps on the same inputs did not reproduce."""


class GaveUp(RuntimeError):
  """Trouble that came back after `max_rewinds` rewinds."""


@dataclasses.dataclass(frozen=True)
class Trouble:
  step: int  # the step whose metrics showed it
  first: int  # the first step of the trouble (the guard's alarm)
  values: dict[str, float]  # that step's metrics, as read


def read_events(workdir: paths.PathLike) -> list[dict[str, Any]]:
  path = paths.path(workdir) / EVENTS
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Policy:
  """The host side of the guard: reads its alarm, keeps the record of rewinds and says where
  the data of a resumed step is."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: paths.PathLike,
               is_main: bool, ledger: Ledger) -> None:
    self.settings = GuardSettings.from_config(config)
    r = config.resilience
    self.max_rewinds = int(r.max_rewinds)
    self.replay = bool(r.replay)
    self.workdir = paths.path(workdir)
    self.is_main = is_main
    self.ledger = ledger
    self.events = read_events(workdir)
    self.trouble: Trouble | None = None
    self.seen_skips = 0

  @property
  def enabled(self) -> bool:
    return self.settings is not None

  def resumed(self, state: Any) -> None:
    """The run's state restored (or initialised): the skips its guard has counted so far are
    not new to this attempt (its first read would record them again)."""
    if self.enabled and getattr(state, "guard", None) is not None:
      self.seen_skips = int(jax.device_get(state.guard.skipped))

  def observe(self, step: int, values: Mapping[str, float]) -> bool:
    """A read of step `step`'s metrics: counts its newly skipped updates in the ledger and
    notes trouble. True when the run must recover (the loss is then not a divergence)."""
    if not self.enabled:
      return False
    skips = int(values.get("skipped_updates", 0))
    if skips > self.seen_skips:
      self.ledger.move("productive", "skipped",
                       (skips - self.seen_skips) * self.ledger.step_time())
      # The skipped step's own values (the guard keeps the latest skip's), not those of
      # the step whose metrics were read: with log_every > 1 they are other steps.
      last = int(values.get("last_skipped_step", 0))
      loss, norm = values.get("last_skipped_loss"), values.get("last_skipped_grad_norm")
      self.record({"kind": "skipped", "seen_at": step, "updates": skips - self.seen_skips,
                   "last_step": last, "loss": loss, "grad_norm": norm})
      log.warning("the spike guard skipped %d update(s) by step %d (the latest at step %d: "
                  "loss %s, gradient norm %s)", skips - self.seen_skips, step, last, loss, norm)
      self.seen_skips = skips
    alarm = int(values.get("spike_alarm", 0))
    loss = values.get("loss", 0.0)
    if (alarm > 0 or not math.isfinite(loss)) and self.trouble is None:
      self.trouble = Trouble(step, alarm or step, dict(values))
    return self.trouble is not None

  def rewinds(self) -> list[dict[str, Any]]:
    return [e for e in self.events if e["kind"] == "rewind"]

  def data_at(self, step: int) -> tuple[int, int]:
    """For a state restored at `step`: (batches to skip past its saved data position, the data
    position after that). A checkpoint saved before a rewind to it holds the position before
    the skip; one saved after a rewind to an earlier step holds the position after it. After
    several rewinds to the same step (the trouble came back), the state still holds the
    position it was saved with, the first of those rewinds' `data_from`, and every skip since
    adds up: the position is the last one's `data_to`."""
    latest = None
    for event in reversed(self.rewinds()):
      if event["rewound_to"] < step:
        break  # saved after this rewind, or deleted by it
      if event["rewound_to"] == step:
        latest = latest or event
        saved = event["data_from"]
    if latest is not None:
      return latest["data_to"] - saved, latest["data_to"]
    for event in reversed(self.rewinds()):
      if event["rewound_to"] < step:
        return 0, step + event["data_to"] - event["rewound_to"]
    return 0, step

  def record(self, event: dict[str, Any]) -> None:
    self.events.append(event)
    if self.is_main:
      path = self.workdir / EVENTS
      text = path.read_text() if path.exists() else ""
      path.write_text(text + json.dumps(event) + "\n")

  def check_rewind_allowed(self, trouble: Trouble) -> None:
    done = len(self.rewinds())
    if done >= self.max_rewinds:
      self.record({"kind": "gave_up", "step": trouble.step, "trouble_from": trouble.first,
                   "rewinds": done})
      raise GaveUp(
          f"trouble at step {trouble.first} (seen at step {trouble.step}: "
          f"loss={trouble.values.get('loss')}, grad_norm={trouble.values.get('grad_norm')}) "
          f"came back after {done} rewind(s) (resilience.max_rewinds={self.max_rewinds}); "
          f"stopping. The decisions are in {self.workdir / EVENTS}; lower the learning rate "
          "or look at the data there.")
