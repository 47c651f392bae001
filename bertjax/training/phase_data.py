"""The data of the training phase a step trains in: its iterator, batch shape, row length,
ramp stage and model FLOPs (bertjax.config.phases, bertjax.config.ramp); the loop builds one per
phase and asks it for each step's batch.

The guide: docs/training.md, 'The loop: workloads, step hooks and when metrics are read'.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from bertjax.config import phases, ramp
from bertjax.parallel import distributed, sharding
from bertjax.training import flops
from bertjax.training.trainer import Trainer

log = logging.getLogger(__name__)


class PhaseData:
  """The data iterator, batch shape and model FLOPs of the phase that step `step` trains in
  (bertjax.config.phases): a two-phase run builds a new one at the switch, and the step is
  jitted again for its batch shape at its first batch (`compiled`). With a batch ramp or a
  sequence-length warmup (bertjax.config.ramp) the iterator delivers unit batches of full rows
  for the whole run and each stage takes as many of them per step as it needs, its rows cut to
  its length (`set_stage`)."""

  def __init__(self, workload: Any, trainer: Trainer, step: int) -> None:
    config = workload.config
    self.index = phases.phase_of(config, step)
    self.base_config = phases.config_at(config, step)
    self.ramp = ramp.from_config(self.base_config)
    self.warmup = ramp.seq_warmup_from_config(self.base_config)
    self.full_length = int(self.base_config.seq_length)  # a warmup's rows are cut from these
    self.trainer = trainer
    self.stage: tuple[int, int] | None = None
    self.set_stage(step)
    if self.ramp is None:
      self.batches = workload.batches(self.base_config, self.rows)
    else:
      unit = self.base_config.copy_and_resolve_references()
      unit.batch_size = self.ramp.unit
      self.batches = workload.batches(
          unit, distributed.local_rows(trainer.data_sharding(), self.ramp.unit))
    # Finite epochs: a row stream that runs out ends the run for every process at once.
    self.finite = (self.config.data.source == "corpus" and int(self.config.data.num_epochs) > 0
                   and not self.config.finetune.task)

  @property
  def staged(self) -> bool:
    return self.ramp is not None or self.warmup is not None

  def samples_before(self, step: int) -> int:
    """Sequences consumed by steps 0..step-1 (0-based)."""
    if self.ramp is not None:
      return self.ramp.samples_before(step)
    return step * int(self.base_config.batch_size)

  def stage_of(self, step: int) -> tuple[int, int]:
    """(ramp stage, row length) of the step with 0-based index `step`."""
    return (self.ramp.stage_index(step) if self.ramp else 0,
            self.warmup.length_at(self.samples_before(step)) if self.warmup
            else self.full_length)

  def set_stage(self, step: int) -> bool:
    """Takes the batch and row length of the stage that step `step` (0-based) trains in;
    whether they changed (the step then compiles again at its next batch)."""
    stage = self.stage_of(step)
    if stage == self.stage:
      return False
    self.stage = stage
    self.config = self.base_config
    if self.staged:
      self.config = self.base_config.copy_and_resolve_references()
      self.config.seq_length = stage[1]
    if self.ramp is not None:
      self.config.batch_size = self.ramp.stages[stage[0]].batch_size
      micro = int(self.base_config.batch_size) // int(self.base_config.grad_accum_steps)
      self.config.grad_accum_steps = ramp.accum_steps(
          int(self.config.batch_size), micro, sharding.batch_ways(self.trainer.mesh,
                                                                  self.trainer.rules))
    # Evaluation reads full rows whatever the warmup's length.
    self.eval_config = self.config
    if self.warmup is not None:
      self.eval_config = self.config.copy_and_resolve_references()
      self.eval_config.seq_length = self.full_length
    self.batch_size = int(self.config.batch_size)
    self.seq_length = int(self.config.seq_length)
    self.accum_steps = int(self.config.grad_accum_steps)
    self.units = self.batch_size // self.ramp.unit if self.ramp else 1
    trainer = self.trainer
    sharding.check_batch(self.batch_size, self.accum_steps, trainer.mesh, trainer.rules)
    # This host's rows of every global batch follow from the batch sharding (on a TPU slice
    # they interleave with other hosts' rows); the data of a row is the same wherever loaded.
    self.layout = distributed.row_layout(trainer.data_sharding(), self.batch_size)
    self.rows = distributed.local_rows(trainer.data_sharding(), self.batch_size)
    self.flops_per_step = flops.run_flops_per_step(trainer.model_config, self.config,
                                                   self.batch_size, self.seq_length)
    self.compiled = False
    return True

  def global_batch(self, trainer: Trainer, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return distributed.global_batch(local, trainer.batch_shardings, self.rows, self.batch_size)

  def next_batch(self) -> dict[str, np.ndarray] | None:
    """This host's rows of the next batch, or None when the data has run out on any host
    (finite epochs; every process gets the same answer at the same step)."""
    parts = []
    try:
      for _ in range(self.units):
        parts.append(next(self.batches))
      exhausted = False
    except StopIteration:
      exhausted = True
      if parts:  # a ramp stage's step needs every unit: the rows of a partial step are dropped
        log.info("the data ran out inside a step of %d units: the %d unit batch(es) taken are "
                 "not trained on", self.units, len(parts))
    if self.finite:
      exhausted = distributed.any_process(exhausted)
    elif exhausted:
      raise RuntimeError("the training data ended although data.num_epochs=0 (repeat forever)")
    if exhausted:
      return None
    batch = parts[0] if self.units == 1 else ramp.interleave(parts)
    if self.seq_length < self.full_length:
      batch = ramp.cut_rows(batch, self.seq_length)
    return batch

  def describe(self) -> str:
    staged = (f", ramp stage {self.stage[0] + 1} of {len(self.ramp.stages)}" if self.ramp
              else "")
    if self.seq_length < self.full_length:
      staged += f", rows cut to {self.seq_length} of {self.full_length} tokens"
    return (f"phase {self.index + 1}: batch {self.batch_size} x {self.seq_length} tokens, "
            f"{self.accum_steps} micro-batch(es){staged}")
