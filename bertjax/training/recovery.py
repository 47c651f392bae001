"""How the loop draws batches and recovers from trouble the spike guard reports.

`Recovery.next_batch` draws each step's batch, counting the data position (steps' worth of
batches drawn since the start of the data) and applying the fault lab's data faults.
`Recovery.recover` acts on the guard's alarm (bertjax.resilience.policy): replay the steps from
the last checkpoint before the trouble on the same batches and compare; a different result is a
hardware fault (HardwareFault); the same one rewinds the run to that checkpoint, skips the
batches drawn since and deletes the later checkpoints.

The guide: docs/resilience.md, 'Rewind and skip'.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

from bertjax.checkpoints.train_state import TrainCheckpoints
from bertjax.config import phases
from bertjax.resilience.faults import Faults
from bertjax.resilience.ledger import Ledger
from bertjax.resilience.policy import GaveUp, HardwareFault, Policy, Trouble
from bertjax.resilience.watchdog import EXIT_HARDWARE
from bertjax.training.phase_data import PhaseData
from bertjax.training.trainer import Trainer, TrainState

log = logging.getLogger(__name__)

# The metrics a replay must reproduce bit for bit.
_REPLAYED = ("loss", "grad_norm", "skipped_updates", "spike_alarm")


class Recovery:
  """The loop's data position and its answer to the guard's alarm."""

  def __init__(self, config: ml_collections.ConfigDict, workload: Any, trainer: Trainer,
               checkpoints: TrainCheckpoints, policy: Policy, ledger: Ledger,
               faults: Faults | None,
               dispatch: Callable[[Trainer, PhaseData, TrainState, dict], tuple]) -> None:
    self.config = config
    self.workload = workload
    self.trainer = trainer
    self.checkpoints = checkpoints
    self.policy = policy
    self.ledger = ledger
    self.faults = faults
    self._dispatch = dispatch
    self.position = 0  # the data position of the next batch drawn
    self.replaying = False  # inside `_replay`

  def resumed(self, phase: PhaseData, step: int) -> None:
    """After the loop restored (or initialised) the state at `step`: the batches a rewind to
    this step skipped are skipped again, and the data position is known."""
    skip, self.position = self.policy.data_at(step)
    if skip:
      log.info("step %d was rewound to before: skipping the %d batch(es) the rewind skipped",
               step, skip)
      for _ in range(skip):
        phase.next_batch()

  def next_batch(self, phase: PhaseData, step: int) -> dict[str, np.ndarray] | None:
    """This host's rows of the batch of step `step` (1-based), with its data faults."""
    if self.faults and not self.replaying:  # machine faults are transient: not replayed
      self.faults.hang_data(step)
      self.faults.delay_data(self.position)
    local = phase.next_batch()
    if local is not None and self.faults:
      self.faults.add_scale(local, self.position)
    self.position += 1
    return local

  def _restore_at(self, step: int, current: PhaseData) -> tuple[TrainState, PhaseData]:
    """The state and data of checkpoint `step` (0 with no checkpoint: the initial state), the
    batches of a rewind to it skipped again. The step compiled for `current` serves it when
    its batch shape is the same."""
    phase = PhaseData(self.workload, self.trainer, step)
    phase.compiled = current.compiled and (phase.index, phase.stage) == (current.index,
                                                                         current.stage)
    if step in self.checkpoints.steps():
      state, _ = self.checkpoints.restore(self.trainer.abstract_state(), phase.batches, step)
    else:
      state = self.workload.initial_state(self.trainer)
    self.resumed(phase, step)
    return state, phase

  def _follow_rewinds(self, phase: PhaseData, step: int) -> None:
    """In a replay, after step `step`: where an earlier rewind went back to this step, the
    batches it skipped are skipped again, so the replay draws what the run trained on (a
    replay from before that rewind that met the skipped batches would call data trouble a
    hardware fault)."""
    _, position = self.policy.data_at(step)
    if position < self.position:
      raise RuntimeError(f"replay after step {step}: data position {self.position} is past "
                         f"the run's {position} (resilience events: {self.policy.rewinds()})")
    for _ in range(position - self.position):
      phase.next_batch()
    self.position = position

  def _replay(self, start: int, until: int, phase: PhaseData) -> dict[str, float]:
    """Steps start+1..until again from checkpoint `start`, no hooks, no faults of the machine:
    the metrics of step `until`."""
    state, replay_phase = self._restore_at(start, phase)
    metrics = None
    self.replaying = True
    try:
      for step in range(start + 1, until + 1):
        self._follow_rewinds(replay_phase, step - 1)
        local = self.next_batch(replay_phase, step)
        if local is None:
          break
        if not replay_phase.compiled:
          self.trainer.compile_step(local, replay_phase.accum_steps)
          replay_phase.compiled = True
        state, metrics = self._dispatch(self.trainer, replay_phase, state, local)
    finally:
      self.replaying = False
      replay_phase.batches.close()
    values = {k: float(v) for k, v in jax.device_get(metrics).items()} if metrics else {}
    del state
    return values

  def recover(self, state: TrainState, phase: PhaseData, step: int
              ) -> tuple[TrainState, PhaseData, int]:
    """Acts on the policy's trouble: returns the state, data and step to train on from."""
    trouble: Trouble = self.policy.trouble
    self.policy.trouble = None
    self.checkpoints.wait()
    self.policy.check_rewind_allowed(trouble)
    kept = self.checkpoints.steps()
    earlier = [s for s in kept if s < trouble.first]
    start = earlier[-1] if earlier else 0
    if not earlier and kept:
      log.warning("no kept checkpoint is before the trouble at step %d (the oldest is step %d;"
                  " checkpoint.keep): the replay and rewind start from the initial "
                  "state, %d steps back", trouble.first, kept[0], step)
    if phases.phase_of(self.config, start) != phase.index:
      raise GaveUp(f"trouble at step {trouble.first}: the last checkpoint before it (step "
                   f"{start}) is in another training phase; stopping")
    position = self.position
    log.warning("trouble from step %d (seen at step %d: loss=%s grad_norm=%s, %d update(s) "
                "skipped so far)%s", trouble.first, trouble.step, trouble.values.get("loss"),
                trouble.values.get("grad_norm"), int(trouble.values.get("skipped_updates", 0)),
                f"; replaying steps {start + 1}..{trouble.step}" if self.policy.replay else "")
    verdict = "not replayed"
    if self.policy.replay:
      del state  # its buffers go before the replay's
      began = time.monotonic()
      with self.ledger.timing("replayed"):
        again = self._replay(start, trouble.step, phase)
      same = all(np.float32(again.get(k, np.nan)).tobytes()
                 == np.float32(trouble.values.get(k, np.nan)).tobytes() for k in _REPLAYED)
      verdict = "reproduced" if same else "not reproduced"
      log.warning("replay of steps %d..%d (%.1f s): %s", start + 1, trouble.step,
                  time.monotonic() - began,
                  ", ".join(f"{k} {trouble.values.get(k)} -> {again.get(k)}"
                            for k in _REPLAYED))
      if not same:
        self.policy.record({"kind": "hardware_fault", "step": trouble.step,
                            "trouble_from": trouble.first, "replayed_from": start,
                            "seen": {k: trouble.values.get(k) for k in _REPLAYED},
                            "replayed": {k: again.get(k) for k in _REPLAYED}})
        self.ledger.flush()
        raise HardwareFault(
            f"steps {start + 1}..{trouble.step} replayed on the same inputs gave other results "
            f"(loss {trouble.values.get('loss')} then {again.get('loss')}): a hardware fault "
            f"(silent data corruption), not the data's or the model's. Exiting with status "
            f"{EXIT_HARDWARE} so the launcher restarts the run on other machines from its "
            "last checkpoint.")
    # Rewind: the steps since `start` are undone, the batches they drew are skipped.
    with self.ledger.timing("restore"):
      state, phase_now = self._restore_at(start, phase)
    phase.batches.close()
    drawn_from = self.position
    for _ in range(position - self.position):
      phase_now.next_batch()
    self.position = position
    later = [s for s in self.checkpoints.steps() if s > start]
    for s in later:
      self.checkpoints.manager.delete(s)
    event = {"kind": "rewind", "step": trouble.step, "trouble_from": trouble.first,
             "rewound_to": start, "data_from": drawn_from, "data_to": position,
             "replay": verdict, "attempt": self.ledger.attempt,
             "loss": trouble.values.get("loss"), "grad_norm": trouble.values.get("grad_norm"),
             "deleted_checkpoints": later}
    self.policy.record(event)
    restored_skips = int(jax.device_get(state.guard.skipped))
    # The undone steps' time becomes `rewound`'s, each step's once: the skipped ones' was
    # moved to `skipped` when their skips were read.
    self.ledger.rewind(step - start, self.policy.seen_skips - restored_skips)
    self.policy.seen_skips = restored_skips
    log.warning("rewound to step %d; skipped data positions %d..%d (rewind %d of at most %d)",
                start, drawn_from, position - 1, len(self.policy.rewinds()),
                self.policy.max_rewinds)
    self.ledger.flush()
    return state, phase_now, start
