"""One run per workdir: a lock held for the run's life, and the config a resumed run may differ in.

Two `bertjax train` processes writing one workdir corrupt each other silently (interleaved
metrics, each other's checkpoints, the config file of whichever started last), so a run holds
WORKDIR/lock.json, with a heartbeat, while it trains; a lock whose holder is gone is taken over.
A resumed run is compared with the config its checkpoint was written with: changes to how the
run is carried out are listed, any other change is refused unless `resume_with_changes=true`.

The guide: docs/training.md, 'One run per workdir'.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

from flax import traverse_util

from bertjax import paths

log = logging.getLogger(__name__)

LOCK_FILE = "lock.json"
HEARTBEAT_S = 30.0
# Five missed heartbeats: the holder is gone. A preempted TPU slice takes minutes to re-create.
STALE_S = 150.0

# Keys (or groups, with a trailing dot) a resumed run may change freely: they decide how the run
# is carried out, not what it computes. `num_train_steps` also sets the schedule's length.
HARMLESS = ("log_every", "eval_every", "eval_steps", "checkpoint.", "profile.", "distributed.",
            "wandb.",
            "mesh.", "dcn_mesh.", "sharding_rules", "restore_step", "num_train_steps",
            "grad_accum_steps", "reference_params", "init_from", "seed", "resume_with_changes",
            "data.num_workers", "data.prefetch", "data.build_workers", "model.remat_policy",
            # What a corrupt record does (skip it, or stop): a run stopped by one resumes.
            "data.corrupt_records",
            # The spike guard, rewinds and checks: what a run does about trouble, not what it
            # computes without any (a guard turned on for a run in trouble starts afresh).
            "resilience.",
            # What a fine-tune writes at its end, not what it trains.
            "finetune.export_hf", "finetune.generate_examples", "finetune.max_new_tokens")
# ... except for a fine-tune, whose OUT/best names the weights it started from as its base.
FINETUNE_MEANINGFUL = ("init_from",)


class WorkdirBusy(ValueError):
  """Another live run holds the workdir."""


class ConfigChanged(ValueError):
  """A resume whose config differs from the checkpoint's in what the run computes."""


def _record(token: str) -> dict[str, Any]:
  now = time.time()
  return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_ticks(os.getpid()),
          "token": token, "started": now, "heartbeat": now, "command": " ".join(sys.argv)}


def _proc_stat(pid: int) -> list[str] | None:
  """Fields of /proc/PID/stat after the command name, or None off Linux or for no such pid."""
  try:
    text = open(f"/proc/{pid}/stat").read()
  except OSError:
    return None
  return text[text.rindex(")") + 2:].split()


def _start_ticks(pid: int) -> str | None:
  """When the pid started (clock ticks since boot), to tell a reused pid from the holder."""
  fields = _proc_stat(pid)
  return fields[19] if fields else None


def _pid_alive(pid: int, started: str | None = None) -> bool:
  """Whether pid still runs. A zombie has died (containers whose init does not reap orphans keep
  killed processes as zombies), and a pid that started at another time is a new process."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # another user's process: still running
  fields = _proc_stat(pid)
  if fields is None:
    return True
  if fields[0] in ("Z", "X"):
    return False
  return started is None or fields[19] == started


class WorkdirLock:
  """WORKDIR/lock.json for the life of a run (docs/training.md, 'One run per workdir')."""

  def __init__(self, workdir: paths.PathLike):
    self.path = paths.path(workdir) / LOCK_FILE
    self.token = uuid.uuid4().hex
    self._record = _record(self.token)
    self._beat = 0.0
    self.held = False

  def _read(self) -> dict[str, Any] | None:
    """The holder's record; None without a lock; {"unreadable": True} for a file that does not
    parse (a write cut short by a kill: locks are created whole, by a link, and refreshed by an
    atomic replace, so no live run leaves one)."""
    try:
      record = json.loads(self.path.read_text())
    except FileNotFoundError:
      return None
    except (ValueError, UnicodeDecodeError):
      return {"unreadable": True}
    return record if isinstance(record, dict) else {"unreadable": True}

  def _stale_because(self, holder: dict[str, Any]) -> str | None:
    """Why the holder is gone, or None when it may still be running."""
    if holder.get("unreadable"):
      return "the lock file does not parse (a write cut short by a killed run)"
    host, pid = holder.get("host"), int(holder.get("pid", -1))
    if host == socket.gethostname():
      if pid == os.getpid() and holder.get("token") != self.token:
        return "an earlier run of this process"
      alive = _pid_alive(pid, holder.get("pid_start"))
      return None if alive else f"pid {pid} on {host} is no longer running"
    age = time.time() - float(holder.get("heartbeat", 0))
    return f"its last heartbeat was {age:.0f} s ago" if age > STALE_S else None

  def _create(self) -> bool:
    """Writes our record if no lock exists; False when another run got there first."""
    text = json.dumps(self._record, indent=2) + "\n"
    if not paths.is_remote(self.path):
      temporary = self.path.parent / f"{LOCK_FILE}.{self.token}"
      temporary.write_text(text)
      try:
        os.link(temporary, self.path)  # atomic: fails when the file exists
        return True
      except FileExistsError:
        return False
      finally:
        temporary.unlink()
    # Object stores have no exclusive create here: write, wait, and see whose record stayed.
    self.path.write_text(text)
    time.sleep(1.0)
    holder = self._read()
    return holder is not None and holder.get("token") == self.token

  def acquire(self) -> None:
    """Takes the lock (taking over a stale one, with a message) or raises WorkdirBusy."""
    try:
      self.path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise ValueError(f"workdir {self.path.parent} cannot be created: "
                       f"{e.strerror or e}") from None
    for _ in range(3):
      holder = self._read()
      if holder is not None:
        stale = self._stale_because(holder)
        if stale is None:
          started = time.strftime("%Y-%m-%d %H:%M:%S",
                                  time.localtime(float(holder.get("started", 0))))
          raise WorkdirBusy(
              f"{self.path.parent} is in use by pid {holder.get('pid')} on "
              f"{holder.get('host')} (started {started}: {holder.get('command', '?')}); "
              f"two runs in one workdir corrupt each other. Stop that run or use another "
              f"workdir; if that run is gone, delete {self.path}")
        log.warning("taking over %s: %s", self.path, stale)
        try:
          self.path.unlink()
        except FileNotFoundError:
          pass
      try:
        created = self._create()
      except OSError as e:
        raise ValueError(f"workdir {self.path.parent} is not writable: {e.strerror or e}"
                         ) from None
      if created:
        self.held, self._beat = True, time.monotonic()
        return
    raise WorkdirBusy(f"{self.path}: another run took the lock while this one started")

  def heartbeat(self) -> None:
    """Refreshes the heartbeat (at most every HEARTBEAT_S; cheap to call every step)."""
    if not self.held or time.monotonic() - self._beat < HEARTBEAT_S:
      return
    self._beat = time.monotonic()
    self._record["heartbeat"] = time.time()
    text = json.dumps(self._record, indent=2) + "\n"
    try:
      if paths.is_remote(self.path):  # an object is replaced whole
        self.path.write_text(text)
      else:  # a kill between truncating and writing would leave an empty lock: replace it
        temporary = self.path.parent / f"{LOCK_FILE}.{self.token}.beat"
        temporary.write_text(text)
        os.replace(temporary, self.path)
    except OSError as e:  # a full disk must not stop training; the next beat tries again
      log.warning("could not refresh %s: %s", self.path, e)

  def release(self) -> None:
    if not self.held:
      return
    self.held = False
    holder = self._read()
    if holder is not None and holder.get("token") == self.token:
      try:
        self.path.unlink()
      except OSError:
        pass


def _harmless(key: str, finetune: bool) -> bool:
  if finetune and key in FINETUNE_MEANINGFUL:
    return False
  return any(key == h or (h.endswith(".") and key.startswith(h)) for h in HARMLESS)


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any],
                   hints: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
  """(harmless, meaningful) differences between two resolved configs, as "key: a -> b",
  followed by " (hint)" where `hints` has one for the key (a setting resolved per machine:
  why it differs)."""
  a, b = (traverse_util.flatten_dict(dict(c), sep=".") for c in (saved, current))
  finetune = bool(b.get("finetune.task"))
  harmless, meaningful = [], []
  for key in sorted(set(a) | set(b)):
    if a.get(key, "<absent>") != b.get(key, "<absent>"):
      line = f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}"
      if hints and key in hints:
        line += f" ({hints[key]})"
      # A setting added to bertjax after the checkpoint was written: its default keeps what the
      # older version did, so it is listed but does not block the resume.
      new_setting = key not in a
      (harmless if new_setting or _harmless(key, finetune) else meaningful).append(line)
  return harmless, meaningful


def check_resume_config(saved: Mapping[str, Any], current: Mapping[str, Any], step: int,
                        allow_changes: bool, hints: Mapping[str, str] | None = None) -> None:
  """Lists what changed since the checkpoint of `step` was written; raises ConfigChanged for a
  change in what the run computes unless `allow_changes`. `hints`: as `config_changes`."""
  harmless, meaningful = config_changes(saved, current, hints)
  if harmless:
    log.info("resuming at step %d with changed settings: %s", step, "; ".join(harmless))
  if meaningful and not allow_changes:
    raise ConfigChanged(
        f"the config differs from the one checkpoint step {step} was written with, in what "
        f"the run computes: {'; '.join(meaningful)}. Use a new workdir for a new run, or set "
        "--config.resume_with_changes=true to continue this one with the changes")
  if meaningful:
    log.warning("resuming at step %d with a changed config (resume_with_changes): %s", step,
                "; ".join(meaningful))

