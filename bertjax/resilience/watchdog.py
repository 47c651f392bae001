"""The hang watchdog and the slow-host check.

Every process ticks the watchdog once per step. In steady training (the ledger's category is
`productive` or `data_wait`) a step that takes longer than max(hang_factor x the p99 of the
recent steps, hang_floor_s) is a hang; before the first steady steps, and during compilation,
evaluation, saves and restores, `distributed.step_timeout_s` applies. A hang writes every
thread's Python stack to the log and to WORKDIR/hangs/, counts the wait as `hung` in the ledger
and exits with status 6 (EXIT_HUNG), which the launchers restart on. A peer that hangs blocks
the others in their next collective, so every process dumps its stacks.

The guide: docs/resilience.md, 'Hangs and slow hosts'.
"""

from __future__ import annotations

import collections
import faulthandler
import io
import json
import logging
import os
import sys
import threading
import time
import traceback

import jax
import numpy as np
from jax.experimental import multihost_utils

from bertjax import paths
from bertjax.resilience.ledger import Ledger

log = logging.getLogger(__name__)

# Exit statuses of the faults a launcher restarts a run on (bertjax.cli.common has the table):
# a hardware fault found by replaying the steps (restart on other machines), a hang.
EXIT_HARDWARE, EXIT_HUNG = 5, 6
# The categories in which a step is expected every step time.
_STEADY = ("productive", "data_wait")
# Steady steps seen before the adaptive limit applies.
_MIN_INTERVALS = 5


EXIT_FILE = "exit.json"


def record_exit(workdir: paths.PathLike, status: int, reason: str) -> None:
  """WORKDIR/exit.json: the status a restartable failure exits with, for a launcher that sees
  another (srun reports a peer killed after the first exit, not the first status)."""
  try:
    (paths.path(workdir) / EXIT_FILE).write_text(json.dumps(
        {"status": status, "process": jax.process_index(), "reason": reason[:500]}) + "\n")
  except Exception as e:  # noqa: BLE001 - the exit status itself still says it
    print(f"bertjax: could not write {EXIT_FILE}: {e}", file=sys.stderr, flush=True)


def clear_exit(workdir: paths.PathLike) -> None:
  """A new attempt starts: the last one's exit record is history."""
  path = paths.path(workdir) / EXIT_FILE
  if path.exists():
    path.unlink()


def thread_stacks() -> str:
  """Every thread's Python stack, named."""
  names = {t.ident: t.name for t in threading.enumerate()}
  out = io.StringIO()
  for ident, frame in sys._current_frames().items():
    out.write(f"--- thread {names.get(ident, ident)} ---\n")
    out.write("".join(traceback.format_stack(frame)))
  return out.getvalue()


class HangWatchdog:
  """Exits the process with EXIT_HUNG, its stacks in the log, when a step does not come."""

  def __init__(self, ledger: Ledger, workdir: paths.PathLike, first_timeout_s: float,
               factor: float, floor_s: float) -> None:
    self.ledger = ledger
    self.workdir = paths.path(workdir)
    self.first_timeout_s = float(first_timeout_s)
    self.factor = float(factor)
    self.floor_s = float(floor_s)
    self.intervals: collections.deque[float] = collections.deque(maxlen=256)
    self.peers = Peers()
    self.steps = 0
    self._last = time.monotonic()
    self._stop = threading.Event()
    self._thread = None

  def start(self) -> None:
    """Starts watching (inside the loop's try, whose finally stops it: a watchdog left behind
    by a failed start would end the process minutes later)."""
    if self.first_timeout_s > 0 and self._thread is None:
      self._last = time.monotonic()
      self._thread = threading.Thread(target=self._watch, name="bertjax-watchdog",
                                      daemon=True)
      self._thread.start()

  def tick(self, steady: bool = True) -> None:
    """A step completed (`steady`: a steady-state step whose interval counts)."""
    now = time.monotonic()
    if steady:
      self.intervals.append(now - self._last)
    self._last = now
    self.steps += 1

  def limit(self) -> float:
    """How long the current wait may last."""
    if self.ledger.category not in _STEADY or len(self.intervals) < _MIN_INTERVALS:
      return self.first_timeout_s
    return max(self.factor * float(np.percentile(self.intervals, 99)), self.floor_s)

  def stop(self) -> None:
    self._stop.set()

  def _watch(self) -> None:
    while not self._stop.wait(min(1.0, self.floor_s / 10 if self.floor_s else 1.0)):
      idle = time.monotonic() - self._last
      limit = self.limit()
      self.peers.beat(self.steps)
      found = self.peers.hang_found()
      if found:
        self._fire(idle, limit, f"{found} found a hang")
      elif idle > limit:
        self.peers.announce(f"process {jax.process_index()}")
        self._fire(idle, limit, "")

  def _fire(self, idle: float, limit: float, reason: str) -> None:
    where = f"process {jax.process_index()} of {jax.process_count()}"
    behind = self.peers.behind()
    print(f"bertjax: {where}: hang: "
          + (f"{reason}; " if reason else "")
          + f"no step completed here in {idle:.0f} s (limit {limit:.0f} s, during "
          f"{self.ledger.category}){behind}; every thread's stack follows, then exiting with "
          f"status {EXIT_HUNG} so the launcher restarts the run from its last checkpoint.",
          file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    record_exit(self.workdir, EXIT_HUNG, f"hang: no step in {idle:.0f} s")
    self.peers.acknowledge()
    try:
      hangs = self.workdir / "hangs"
      hangs.mkdir(parents=True, exist_ok=True)
      (hangs / f"attempt-{self.ledger.attempt:04d}-process-{jax.process_index()}.txt"
       ).write_text(f"{where}: no step in {idle:.1f} s (limit {limit:.1f} s)\n"
                    + thread_stacks())
      self.ledger.move(self.ledger.category, "hung", idle)
      self.ledger.flush()
    except Exception as e:  # noqa: BLE001 - the exit below matters more than the record
      print(f"bertjax: could not record the hang: {e}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    self.peers.wait_for_acknowledgements()
    os._exit(EXIT_HUNG)


class Peers:
  """The processes' heartbeats and the hang alarm, in jax.distributed's key-value store: a
  process that finds a hang tells the others, so that every process writes its stacks before
  any exits (the coordination service ends them all once one is gone)."""

  HANG_KEY = "bertjax/hang"
  ACK_DIR = "bertjax/hang_ack/"
  BEAT_DIR = "bertjax/heartbeat/"
  ACK_WAIT_S = 10.0

  def __init__(self) -> None:
    from jax._src import distributed as jax_distributed  # noqa: PLC0415 - the runtime client
    self.client = (jax_distributed.global_state.client if jax.process_count() > 1 else None)
    self._beaten: int | None = None  # the step count last written

  def _call(self, fn, *args, default=None):
    try:
      return fn(*args)
    except Exception:  # noqa: BLE001 - a gone coordinator: the watchdog acts alone
      return default

  def beat(self, steps: int) -> None:
    """Writes this process's step count when it changed: a waiting process writes nothing,
    so a pod whose steps take seconds puts a fraction of a write a second on the coordinator
    per host, not one."""
    if self.client is not None and steps != self._beaten:
      self._call(self.client.key_value_set, f"{self.BEAT_DIR}{jax.process_index()}",
                 str(steps), True)
      self._beaten = steps

  def hang_found(self) -> str | None:
    if self.client is None:
      return None
    return self._call(self.client.key_value_try_get, self.HANG_KEY)

  def announce(self, who: str) -> None:
    if self.client is not None:
      self._call(self.client.key_value_set, self.HANG_KEY, who, True)

  def behind(self) -> str:
    """'; steps done per process: 0: 14, 1: 13' from the heartbeats (empty alone)."""
    if self.client is None:
      return ""
    beats = self._call(self.client.key_value_dir_get, self.BEAT_DIR, default=[]) or []
    steps = sorted((int(k.rsplit("/", 1)[1]), int(v)) for k, v in beats)
    return ("; steps done per process: " + ", ".join(f"{p}: {n}" for p, n in steps)
            if steps else "")

  def acknowledge(self) -> None:
    if self.client is not None:
      self._call(self.client.key_value_set, f"{self.ACK_DIR}{jax.process_index()}", "1", True)

  def wait_for_acknowledgements(self) -> None:
    """Until every process has written its stacks (or ACK_WAIT_S); process 0, whose exit
    ends the coordination service and with it every other process, then gives the others a
    moment to exit first with their own status."""
    if self.client is None:
      return
    deadline = time.monotonic() + self.ACK_WAIT_S
    while time.monotonic() < deadline:
      acks = self._call(self.client.key_value_dir_get, self.ACK_DIR, default=None)
      if acks is None or len(acks) >= jax.process_count():
        break
      time.sleep(0.2)
    if jax.process_index() == 0:
      time.sleep(1.0)


class SlowHosts:
  """Names a process whose own work per step (input, dispatch: the time it is not waiting on
  the devices) exceeds the fastest process's by `fraction` of the step time at three log steps
  running. Every process measures itself; the comparison is one small all-gather per log
  step."""

  RUNS = 3

  def __init__(self, fraction: float, ledger: Ledger) -> None:
    self.fraction = float(fraction)
    self.ledger = ledger
    self.enabled = self.fraction > 0 and jax.process_count() > 1
    self._own = 0.0
    self._steps = 0
    self._streak: dict[int, int] = {}
    self.named: dict[int, float] = {}

  def add(self, seconds: float) -> None:
    self._own += seconds

  def step(self) -> None:
    self._steps += 1

  def check(self, step_time: float) -> None:
    """At a log step, on every process at once."""
    if not self.enabled or not self._steps or step_time <= 0:
      return
    own = np.asarray([self._own / self._steps], np.float64)
    self._own, self._steps = 0.0, 0
    every = np.asarray(multihost_utils.process_allgather(own)).reshape(-1)
    excess = (every - every.min()) / step_time
    for process, value in enumerate(excess):
      self._streak[process] = self._streak.get(process, 0) + 1 if value > self.fraction else 0
      if self._streak[process] >= self.RUNS and process not in self.named:
        self.named[process] = float(value)
        self.ledger.slow_hosts[str(process)] = float(value)
        log.warning("process %d is slower than its peers: its own work per step exceeds the "
                    "fastest process's by %.0f%% of the step time (input pipeline, CPU, "
                    "dispatch); the whole run waits for it", process, 100 * value)
