"""Preemption: SIGTERM (how TPU VMs announce it) or Ctrl-C finish the step, save and exit 0."""

from __future__ import annotations

import logging
import signal
import threading

import jax

from bertjax.checkpoints.train_state import TrainCheckpoints

log = logging.getLogger(__name__)


class Preemption:
  """SIGTERM (how TPU VMs announce preemption) or Ctrl-C: finish the step, save, exit 0.

  One process: a Python handler sets a flag; a second signal while saving changes nothing
  (Orbax commits a step atomically, so even a kill leaves the previous step intact). Several
  processes: JAX's preemption sync point, so that every process stops at the same step."""

  def __init__(self, checkpoints: TrainCheckpoints):
    self._checkpoints = checkpoints
    self.reason = ""
    self._previous = {}
    self._multi = jax.process_count() > 1
    if not self._multi and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame) -> None:
    if not self.reason:
      self.reason = signal.Signals(signum).name
      log.warning("%s received: saving a checkpoint after this step, then exiting",
                  self.reason)
      # Further notices (TPU VMs and schedulers repeat SIGTERM) are ignored by the OS from
      # now on: a Python handler would be reset to the default by the interpreter's own
      # shutdown, and a repeat landing then would kill the run before it exits 0.
      for sig in self._previous:
        signal.signal(sig, signal.SIG_IGN)

  def requested(self, step: int) -> bool:
    if self._multi:
      if self._checkpoints.manager.reached_preemption(step):
        self.reason = "preemption notice"
        return True
      return False
    return bool(self.reason)

  def uninstall(self) -> None:
    if self.reason:
      return  # preempted: the process is on its way out, still ignoring further notices
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
