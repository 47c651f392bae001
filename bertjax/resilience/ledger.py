"""The goodput ledger: where a run's wall-clock time went, across restarts, with no cloud
service. Every moment of an attempt (one start of the run in its workdir) belongs to one
category, switched by the loop as it moves from one kind of work to the next; process 0 writes
the totals to WORKDIR/goodput/attempt-N.json at every log step and save. `report` joins the
attempts: the gaps between them are `down`, and steps trained after the checkpoint an attempt
resumed from are moved from `productive` to `lost`. `bertjax goodput WORKDIR` prints it.

The guide: docs/resilience.md, 'The goodput ledger'.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from bertjax import paths

# The categories an attempt measures as it runs, and every category in the order the report
# prints them: `lost`, `down` and `other` are computed by `report` from the attempts.
MEASURED = ("productive", "startup", "compile", "data_wait", "checkpoint", "evaluation",
            "restore", "skipped", "replayed", "rewound", "integrity_check", "hung", "shutdown")
# Where steps timed as productive go when they turn out not to count (`move`, `rewind`).
STEP_CATEGORIES = ("skipped", "rewound")
CATEGORIES = MEASURED + ("lost", "down", "other")
DIRECTORY = "goodput"


def process_start_time() -> float:
  """When this process started (Unix time): its age from /proc on Linux (the system's uptime
  less the process's start tick, both to 10 ms; the boot time /proc/stat gives is whole
  seconds), else now."""
  try:
    with open("/proc/self/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
    return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
  except (OSError, ValueError, IndexError):
    return time.time()


def attempts_so_far(workdir: paths.PathLike) -> int:
  """How many attempts the workdir's ledger holds."""
  directory = paths.path(workdir) / DIRECTORY
  return len(list(directory.glob("attempt-*.json"))) if directory.exists() else 0


class Ledger:
  """One attempt's clock: every second since the process started is in the category last
  switched to (`startup` first)."""

  def __init__(self, workdir: paths.PathLike, attempt: int, enabled: bool,
               started: float | None = None) -> None:
    self.path = paths.path(workdir) / DIRECTORY / f"attempt-{attempt:04d}.json"
    self.attempt = attempt
    self.enabled = enabled
    self.started = process_start_time() if started is None else started
    # Wall time and the monotonic clock, tied once: intervals are monotonic.
    self._offset = time.time() - time.monotonic()
    self.seconds = dict.fromkeys(MEASURED, 0.0)
    self.category = "startup"
    self._since = time.monotonic()
    self.seconds["startup"] = self._since + self._offset - self.started
    self.restored_step: int | None = None
    self.step = 0
    self.steps = 0  # steps trained in this attempt
    # How many of them were moved out of `productive` since (skipped, rewound), in steps of
    # the mean productive step at the time: `step_time` stays the mean of those left.
    self.moved_steps = 0.0
    self.slow_hosts: dict[str, float] = {}
    if enabled:
      self.path.parent.mkdir(parents=True, exist_ok=True)

  def switch(self, category: str) -> str:
    """Time from now on is `category`'s; returns the category it was."""
    if category not in self.seconds:
      raise ValueError(f"unknown goodput category {category!r}")
    now = time.monotonic()
    self.seconds[self.category] += now - self._since
    previous, self.category, self._since = self.category, category, now
    return previous

  @contextlib.contextmanager
  def timing(self, category: str) -> Iterator[None]:
    previous = self.switch(category)
    try:
      yield
    finally:
      self.switch(previous)

  def move(self, source: str, target: str, seconds: float) -> float:
    """Reclassifies up to `seconds` of `source` as `target` (skipped or rewound steps were
    timed as productive); returns what was moved."""
    self.switch(self.category)
    moved = max(0.0, min(seconds, self.seconds[source]))
    per_step = self.step_time()
    if source == "productive" and target in STEP_CATEGORIES and per_step > 0:
      self.moved_steps += moved / per_step
    self.seconds[source] -= moved
    self.seconds[target] += moved
    return moved

  def rewind(self, undone: int, skipped: int) -> None:
    """A rewind undid `undone` steps, `skipped` of them skipped updates already moved to
    `skipped`: all of them become `rewound`, each once (the skipped ones' time from
    `skipped`, the others' from `productive`)."""
    per_step = self.step_time()
    self.move("skipped", "rewound", skipped * per_step)
    self.move("productive", "rewound", max(0, undone - skipped) * per_step)

  def productive_steps(self) -> float:
    """The steps whose time is `productive`'s: those trained, less those moved out."""
    return max(0.0, self.steps - self.moved_steps)

  def step_time(self) -> float:
    """The mean time of this attempt's productive steps (0 before any), the time since the
    last switch counted: the seconds a caller moves at it are those `move` then finds."""
    self.switch(self.category)
    kept = self.productive_steps()
    return self.seconds["productive"] / kept if kept > 1e-9 else 0.0

  def record(self) -> dict[str, Any]:
    self.switch(self.category)
    return {"attempt": self.attempt, "started": self.started,
            "updated": time.monotonic() + self._offset, "step": self.step,
            "restored_step": self.restored_step, "steps": self.steps,
            "productive_steps": self.productive_steps(),
            "seconds": dict(self.seconds), "slow_hosts": self.slow_hosts}

  def flush(self) -> dict[str, Any]:
    """Writes this attempt's totals (process 0), replacing the last write."""
    record = self.record()
    if self.enabled:
      tmp = self.path.parent / f".{self.path.name}.tmp"
      try:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(self.path)
      except OSError as e:  # a full disk fails the write, which names no file
        raise OSError(e.errno, e.strerror, str(self.path)) from None
    return record

  def goodput(self, earlier: Sequence[dict[str, Any]] = ()) -> float:
    """Productive time over wall time so far, the earlier attempts' included."""
    joined = report([*earlier, self.record()])
    return joined["seconds"]["productive"] / joined["wall"] if joined["wall"] > 0 else 0.0


def read_attempts(workdir: paths.PathLike) -> list[dict[str, Any]]:
  directory = paths.path(workdir) / DIRECTORY
  if not directory.exists():
    return []
  return [json.loads(p.read_text()) for p in sorted(directory.glob("attempt-*.json"))]


def report(attempts: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """The attempts joined: seconds per category, the wall clock from the first start to the
  last write, and per attempt its span and what it lost."""
  seconds = dict.fromkeys(CATEGORIES, 0.0)
  rows = []
  for i, a in enumerate(attempts):
    own = dict(a["seconds"])
    span = a["updated"] - a["started"]
    own["other"] = span - sum(own.values())  # what no category took (the clock's rounding)
    lost = 0.0
    following = attempts[i + 1] if i + 1 < len(attempts) else None
    if following is not None:
      # Steps this attempt trained past the checkpoint the next one resumed from (all of them
      # when it started from scratch: no checkpoint was committed).
      redone = max(0, int(a["step"]) - int(following.get("restored_step") or 0))
      kept = a.get("productive_steps", a["steps"])  # older records: every step trained
      per_step = own["productive"] / kept if kept else 0.0
      lost = min(own["productive"], redone * per_step)
      own["productive"] -= lost
    own["lost"] = lost
    if i:
      own["down"] = max(0.0, a["started"] - attempts[i - 1]["updated"])
    for key, value in own.items():
      seconds[key] = seconds.get(key, 0.0) + value
    rows.append({"attempt": a["attempt"], "span": span, "step": a["step"],
                 "restored_step": a["restored_step"], "lost": lost,
                 "slow_hosts": a.get("slow_hosts", {})})
  wall = attempts[-1]["updated"] - attempts[0]["started"] if attempts else 0.0
  return {"seconds": seconds, "wall": wall, "attempts": rows}


def table(workdir: paths.PathLike) -> list[str]:
  """The lines `bertjax goodput WORKDIR` prints."""
  attempts = read_attempts(workdir)
  if not attempts:
    raise ValueError(f"{workdir}: no goodput ledger ({DIRECTORY}/attempt-*.json); was a run "
                     "trained here?")
  joined = report(attempts)
  wall = joined["wall"]
  share = lambda s: 100 * s / wall if wall > 0 else 0.0  # noqa: E731
  lines = [f"{workdir}: {len(attempts)} attempt(s), wall clock {wall:.1f} s, goodput "
           f"{share(joined['seconds']['productive']):.1f}%",
           f"  {'category':<16}{'seconds':>12}{'share':>9}"]
  for key in CATEGORIES:
    value = joined["seconds"][key]
    if value or key == "productive":
      lines.append(f"  {key:<16}{value:>12.2f}{share(value):>8.1f}%")
  for row in joined["attempts"]:
    slow = ", ".join(f"process {p} (+{100 * f:.0f}% of a step)"
                     for p, f in row["slow_hosts"].items())
    lines.append(f"  attempt {row['attempt']}: {row['span']:.1f} s, "
                 + (f"resumed at step {row['restored_step']}, " if row["restored_step"]
                    is not None else "from scratch, ")
                 + f"reached step {row['step']}"
                 + (f", lost {row['lost']:.1f} s of steps redone" if row["lost"] else "")
                 + (f"; slow host(s): {slow}" if slow else ""))
  return lines
