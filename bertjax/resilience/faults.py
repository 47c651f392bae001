"""The fault-injection lab: faults a run can be told to suffer (`--config.faults.*`), so that
the guard, the replay, the ledger and the watchdog are tested on the CPU lab as they would meet
them on a pod. Off unless set; none of it runs in a run without faults.

Faults of the data (a poisoned or NaN batch) are tied to the data position, so a replay of the
same steps meets them again; faults of the machine (a flipped bit, a kill, a hang, a slow host)
fire on the first `attempts` attempts of the run only (an attempt: one start of the run in its
workdir), as a transient fault would. The guide: docs/resilience.md, 'The fault lab'.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

log = logging.getLogger(__name__)

# The batch field that scales the loss of a poisoned batch (only in runs with data faults).
SCALE_FIELD = "fault_scale"


def _ints(text: str) -> frozenset[int]:
  return frozenset(int(x) for x in str(text).replace(" ", "").split(",") if x)


def _delays(text: str) -> dict[int, float]:
  out = {}
  for item in str(text).replace(" ", "").split(","):
    if item:
      position, seconds = item.split(":")
      out[int(position)] = float(seconds)
  return out


@dataclasses.dataclass(frozen=True)
class Faults:
  """What the `faults` group asks for. Positions are 0-based data positions (the n-th step's
  worth of batches the run draws), steps 1-based train steps."""

  poison: frozenset[int]  # data positions whose loss is multiplied by `poison_scale`
  poison_scale: float
  nan: frozenset[int]  # data positions whose loss is NaN
  flip_bit: frozenset[int]  # steps before which one replica's parameter gets a bit flipped
  flip_param: str  # which parameter: the first whose path holds this (empty: the largest)
  data_delay: dict[int, float]  # data position -> seconds the batch is late
  compile_delay_s: float  # added to each compilation of the step
  kill: int  # SIGKILL the process after this step (0: never)
  hang: str  # "data:STEP" (the batch of STEP never comes) or "collective:STEP" (never sent)
  slow_process: int  # this process works `slow_fraction` more per step (-1: none)
  slow_fraction: float
  process: int  # the process machine faults hit (-1: every one)
  attempts: int  # machine faults fire on attempts 1..attempts
  attempt: int  # this attempt (bertjax.resilience.ledger counts them)

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, attempt: int) -> Faults | None:
    f = config.get("faults")
    if f is None:
      return None
    faults = cls(_ints(f.poison), float(f.poison_scale), _ints(f.nan), _ints(f.flip_bit),
                 str(f.flip_param), _delays(f.data_delay), float(f.compile_delay_s),
                 int(f.kill), str(f.hang), int(f.slow_process), float(f.slow_fraction),
                 int(f.process), int(f.attempts), attempt)
    return faults if faults.any() else None

  def any(self) -> bool:
    return bool(self.poison or self.nan or self.flip_bit or self.data_delay
                or self.compile_delay_s or self.kill or self.hang
                or self.slow_process >= 0)

  @property
  def scales_loss(self) -> bool:
    return bool(self.poison or self.nan)

  def _machine(self) -> bool:
    """Whether machine faults fire in this process and attempt."""
    return (self.attempt <= self.attempts
            and self.process in (-1, jax.process_index()))

  # --- data faults (every attempt, every replay) -------------------------------------------

  def add_scale(self, local: dict[str, np.ndarray], position: int) -> None:
    """Gives this host's rows of the batch at `position` the loss scale it suffers."""
    if not self.scales_loss:
      return
    scale = (np.nan if position in self.nan
             else self.poison_scale if position in self.poison else 1.0)
    rows = len(next(iter(local.values())))
    local[SCALE_FIELD] = np.full((rows,), scale, np.float32)

  def delay_data(self, position: int) -> None:
    if position in self.data_delay and self._machine():
      time.sleep(self.data_delay[position])

  # --- machine faults (first attempts only) ------------------------------------------------

  def delay_compile(self) -> None:
    if self.compile_delay_s and self._machine():
      time.sleep(self.compile_delay_s)

  def before_step(self, step: int, last_interval: float) -> None:
    """Before step `step` (1-based) is dispatched: a hang or a slow host."""
    if not self._machine():
      return
    if self.hang == f"collective:{step}":
      log.warning("fault lab: this process never sends step %d's collectives", step)
      while True:
        time.sleep(3600)
    if self.slow_process == jax.process_index() and last_interval > 0:
      time.sleep(self.slow_fraction * last_interval)

  def hang_data(self, step: int) -> None:
    if self._machine() and self.hang == f"data:{step}":
      log.warning("fault lab: the batch of step %d never comes", step)
      while True:
        time.sleep(3600)

  def after_step(self, step: int) -> None:
    if self.kill and step == self.kill and self._machine():
      log.warning("fault lab: SIGKILL after step %d", step)
      os.kill(os.getpid(), signal.SIGKILL)

  def flip(self, state: Any, step: int) -> Any:
    """`state` with one bit flipped in one device's copy of a parameter, before `step`: the
    exponent's top bit of element 0 of the largest parameter (or the first whose path holds
    `flip_param`), on the last device (its other copies, if it is replicated, stay as they
    were): a weight of 0.02 becomes about 7e36, a norm's scale of 1.0 infinity."""
    if step not in self.flip_bit or not self._machine():
      return state
    named, tree = jax.tree_util.tree_flatten_with_path(state.params)
    leaves = [leaf for _, leaf in named]
    which = max(range(len(leaves)), key=lambda i: leaves[i].size)
    if self.flip_param:  # the first parameter whose path holds it (a norm's scale: 1 -> inf)
      which = next((i for i, (path, _) in enumerate(named)
                    if self.flip_param in jax.tree_util.keystr(path)), which)
    leaf = leaves[which]
    target = max(leaf.sharding.device_set, key=lambda d: d.id)
    shards = []
    for shard in leaf.addressable_shards:
      data = shard.data
      if shard.device == target:
        host = np.array(data)
        bits = host.reshape(-1).view(np.uint32 if host.dtype.itemsize == 4 else np.uint16)
        bits[0] ^= np.uint32(1 << 30) if host.dtype.itemsize == 4 else np.uint16(1 << 14)
        data = jax.device_put(host, shard.device)
        log.warning("fault lab: flipped a bit of %s on device %d before step %d",
                    jax.tree_util.keystr(named[which][0]), target.id, step)
      shards.append(data)
    leaves[which] = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)
    return state.replace(params=jax.tree.unflatten(tree, leaves))


def scaled(objective: Any, batch: dict[str, jax.Array]) -> tuple[Any, dict[str, jax.Array]]:
  """The objective with its loss scaled by the batch's fault scale, and the batch without it
  (inside the jitted step; the identity for a batch without the field)."""
  if SCALE_FIELD not in batch:
    return objective, batch
  batch = dict(batch)
  scale = jnp.max(batch.pop(SCALE_FIELD))

  def scaled_objective(params, batch, *args, **kwargs):
    loss, metrics = objective(params, batch, *args, **kwargs)
    return loss * scale, metrics
  return scaled_objective, batch
